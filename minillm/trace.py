"""The trace: a structured record of every phase of one request.

Pass a :class:`Trace` to :func:`~minillm.generate.generate`, :func:`~minillm.phases.prefill`
or :func:`~minillm.phases.decode_step` (``trace=``) and it collects one event per phase:

    tokenize -> prefill -> decode -> decode -> ... -> metrics -> detokenize
                (1st token)  (2nd)    (3rd)           TTFT, TPOT, roofline verdicts

With ``trace=None`` (the default) nothing is timed or recorded: no cost.

Levels:
    "steps" (default): one event per phase and per decode step.
    "layers": also one "layer" event per layer per forward pass (shapes of the attention
        and MLP inputs and outputs, K/V after the cache write, time). ``keep`` stores
        chosen activations (names or glob patterns, TransformerLens style, e.g.
        "blocks.3.attn.hook_pattern") in ``trace.activations`` for plotting.

Timings: ``time.perf_counter()``; on a GPU the device is synchronised before each clock
read, but only when tracing (at level "layers", after every layer, which slows it).

Event schema (``trace.to_records()``, one JSON object a line in ``to_jsonl``;
:func:`minillm.views.chrome_trace.write_trace` draws them on a timeline for Perfetto). Every
event has ``kind`` and ``t_ms`` (when it was recorded); times are ms since
``trace.start_s`` (the request start), bytes are bytes, FLOPs are FLOP.

    trace      schema_version, level, keep, n_candidates
    model      n_layers, d_model, n_heads, n_kv_heads, head_dim, vocab_size, max_seq_len,
               dtype, device, weights_bytes, kv_bytes_per_token, attn_impl, decode_path
               (minillm.fast.choose: the layout, products or compiled step chosen for this machine; None: plain)
    tokenize   start_ms, end_ms, time_ms, text, n_tokens, token_ids, token_strings
    prefill    step, start_ms, time_ms (the forward pass), end_ms, batch_size, n_tokens,
               token_ids, position_first, position_last, cached_tokens,
               cache_length_before, cache_length_after, kv_written_shape (per layer, K and V
               each), kv_written_bytes, kv_cache_shape (per layer, after the write),
               kv_bytes (cache bytes used after), flops, bytes, weights_bytes,
               kv_read_bytes, arithmetic_intensity_flop_per_byte, attained_flop_per_s,
               attained_bytes_per_s, attn_impl, cpu_time_ms (process CPU time in the pass)
               + the sampling fields below when generate() picked a token from its logits
    decode     step, start_ms, time_ms, end_ms, batch_size, input_token_id(, input_token_text),
               position, cache_length_before, cache_length_after, kv_cache_shape, kv_bytes,
               flops, bytes, weights_bytes, kv_read_bytes,
               arithmetic_intensity_flop_per_byte, attained_flop_per_s,
               attained_bytes_per_s, attn_impl ("c" where minillm.fast.attention
               ran it in C, "amx" on the matrix units), cpu_time_ms + the sampling fields
      sampling fields: next_token_id(, next_token_text), next_token_prob, next_token_logprob,
               next_token_rank (0 = the most likely), candidates (the top n_candidates of the
               model's distribution: [{token_id(, text), prob}], softmax of the raw logits),
               sampling ({"method": "greedy"} or {"method": "sampled", temperature, top_k,
               top_p, seed}), sample_ms, end_ms (when the token was known; TTFT for the
               prefill event), finish_reason (None, or why generation stopped),
               allowed_tokens (only with constrained decoding: how many ids the mask allowed)
    layer      step, phase, layer, name ("blocks.{i}"), start_ms, time_ms, attn_in_shape, q_shape,
               k_shape, v_shape, k_cache_shape, v_cache_shape, attn_out_shape,
               mlp_in_shape (the residual after attention), mlp_out_shape, resid_post_shape
    activation step, name, index, shape, dtype (the tensor is trace.activations[name][index])
    metrics    n_prompt_tokens, n_output_tokens, ttft_ms, tpot_ms, itl_ms, itl_p50_ms,
               itl_p90_ms, itl_p99_ms, e2e_ms, output_throughput_tok_s,
               prefill_throughput_tok_s, mbu, finish_reason (see minillm.metrics)
    roofline   phase ("prefill" | "decode"), n_passes, flops, bytes, time_ms,
               arithmetic_intensity_flop_per_byte, compute_floor_ms, memory_floor_ms,
               floor_ms, attained_flop_per_s, attained_bytes_per_s, roofline_fraction,
               bound ("compute-bound" | "memory-bound" | "overhead-bound"), explanation,
               hardware, peak_flop_per_s, peak_bytes_per_s, ridge_point_flop_per_byte,
               load_average_1m, cpu_count, torch_threads, cpu_share (on a CPU: the process's
               CPU time / (time x torch threads); well below 1 when other processes ran)
    detokenize time_ms (spent turning ids into text), n_tokens, text
    warmup     time_ms (the CLI's warm-up pass before the request; not part of it)
    prefix_*   prefix cache events (prefix_lookup, prefix_hit, prefix_insert, prefix_evict),
               fields as minillm.prefix_cache records them
    all_reduce, all_gather   a tensor-parallel model's collectives, recorded by minillm.distributed.comm
               while the group records into this trace (rank 0): name (the module, e.g.
               "blocks.3.attn.o_proj"), shape, bytes, ring_bytes_per_rank, world_size, backend,
               start_ms, time_ms (waiting for the slowest rank included)

Shapes are lists, e.g. ``[B, n_kv_heads, S, head_dim]`` = ``[1, 3, 40, 64]``.
"""

from __future__ import annotations

import fnmatch
import html
import json
import os
import re
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from .costs import PhaseCost, prefill_cost, with_weights_bytes
from .hardware import roofline
from .metrics import RequestMetrics
from .units import fmt_num

SCHEMA_VERSION = 1
LEVELS = ("steps", "layers")
PASS_KINDS = ("prefill", "decode")


_SANS = "font-family:system-ui,sans-serif"  # not the browser's default serif


class Event(dict):
    """One trace event: a plain dict with a ``kind`` (JSON-ready), shown as a table in notebooks."""

    @property
    def kind(self) -> str:
        return self["kind"]

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td style='text-align:left'><code>{html.escape(k)}</code></td>"
            f"<td style='text-align:left'>{html.escape(_short(v))}</td></tr>"
            for k, v in self.items()
        )
        return f"<div style='{_SANS}'><b>{html.escape(self.kind)}</b><table>{rows}</table></div>"


class Events(list):
    """A list of events, shown as one table in notebooks (a column per field)."""

    def _repr_html_(self) -> str:
        if not self:
            return "<i>no events</i>"
        columns = list(dict.fromkeys(k for e in self for k in e if k not in ("candidates", "token_ids")))
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_short(e.get(c, '')))}</td>" for c in columns) + "</tr>"
            for e in self
        )
        return f"<table style='{_SANS}'><tr>{head}</tr>{body}</table>"


class Trace:
    """Records the events of one request; pass it as ``trace=`` to generate / prefill / decode_step.

    Args:
        level: "steps" (default) or "layers" (adds one "layer" event per layer per pass).
        keep: activation names or glob patterns to store, e.g. ``["blocks.3.attn.hook_pattern"]``,
            ``["blocks.*.hook_resid_post"]`` or ``["logits"]`` (each pass's last-position
            logits, float32 [B, vocab]). Names are those of the model's ``hook`` (see
            :mod:`minillm.model`). Stored on the CPU in ``activations[name]``, one tensor per
            pass, in pass order. ``hook_pattern`` exists only with eager attention: for
            traced passes that keep it, the model is switched to ``attn_impl="eager"`` and
            restored afterwards (the logits are the same).
        n_candidates: how many top next-token candidates each step records (default 5).
        tokenizer: optional; when given, token ids in events also get their text.
        hardware: optional :class:`~minillm.hardware.HardwareProfile`; when given, the
            end of the request also records the roofline verdicts and MBU.

    Event times are ms since ``start_s``, the request start: the clock starts at the first
    event recorded after the header (a span, a record, or the first pass), so a trace made
    in one notebook cell and used in the next does not count the time in between.

    One trace holds one request: a prefill after a sampled token, or any pass after the
    metrics, is refused with a ValueError (make a new ``Trace()`` for each request).
    Passes without sampling (several prefills onto one cache, then decode steps) are fine.

    Raises ValueError for a bad level, keep, n_candidates, tokenizer or hardware.
    """

    def __init__(self, level: str = "steps", keep=(), n_candidates: int = 5, tokenizer=None, hardware=None):
        if level not in LEVELS:
            raise ValueError(f"trace level must be one of {', '.join(LEVELS)}, got {level!r}")
        if isinstance(keep, str):
            keep = (keep,)
        _check_args(keep, n_candidates, tokenizer, hardware)
        self.level = level
        self.keep = tuple(keep)
        self.n_candidates = n_candidates
        self.tokenizer = tokenizer
        self.hardware = hardware
        self.start_s = time.perf_counter()
        self.events: Events = Events()
        self.activations: dict[str, list[torch.Tensor]] = {}
        self._n_passes = 0
        self._token_times_s: list[float] = []
        self._model_recorded = False
        self._last_pass: Event | None = None
        self.record("trace", schema_version=SCHEMA_VERSION, level=level, keep=list(self.keep),
                    n_candidates=n_candidates)

    # -- recording ----------------------------------------------------------------------

    def now_ms(self) -> float:
        """Milliseconds since the trace (the request) started."""
        return (time.perf_counter() - self.start_s) * 1e3

    def record(self, kind: str, **fields) -> Event:
        """Append an event of any kind (fields must be JSON-serialisable) and return it."""
        self._start_clock()
        event = Event(kind=kind, t_ms=fields.pop("t_ms", self.now_ms()), **fields)
        self.events.append(event)
        return event

    @contextmanager
    def span(self, kind: str, **fields):
        """Time a block as one event: ``with trace.span("tokenize") as e: ...; e["n_tokens"] = 5``.

        The event gets start_ms, end_ms and time_ms and is recorded when the block ends.
        """
        self._start_clock()
        event = Event(kind=kind, t_ms=0.0, start_ms=self.now_ms(), **fields)
        yield event
        event["end_ms"] = event["t_ms"] = self.now_ms()
        event["time_ms"] = event["end_ms"] - event["start_ms"]
        self.events.append(event)

    def forward(self, phase: str, model, token_ids: torch.Tensor, cache, hook=None, last_only: bool = False,
                compiled=None):
        """Run ``model(token_ids, cache)`` as one traced pass and record a prefill or decode event.

        Called by :func:`~minillm.phases.prefill` and :func:`~minillm.phases.decode_step`;
        ``token_ids`` is [B, T] int64, ``hook`` an extra observer. ``compiled``: the model's
        compiled decode step (:mod:`minillm.fast.compile`), timed instead of the eager layers when
        nothing inside them is observed (level "steps", no hook, no kept activation but logits),
        so the trace measures the step the model runs untraced. Returns the logits [B, T, vocab].
        Raises ValueError when the pass would start a second request in this trace.
        """
        self._check_same_request(phase)
        self._start_clock()
        if not self._model_recorded:
            self._record_model(model, cache)
        step, self._n_passes = self._n_passes, self._n_passes + 1
        observer = _LayerObserver(self, step, phase, hook, cache.k.device) if self._observes() else hook
        length_before = cache.length
        previous_impl = model.attn_impl
        if self._keeps_pattern(model.config.n_layers):
            model.attn_impl = "eager"  # only eager attention materialises the pattern
        try:
            synchronize(cache.k.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            if compiled is not None and observer is None:
                logits = compiled(model, token_ids, cache)[:, None]  # [B, vocab] -> [B, 1, vocab]
            else:
                logits = model(token_ids, cache=cache, hook=observer, last_only=last_only)
            synchronize(cache.k.device)
            end, cpu_time_s = time.perf_counter(), time.process_time() - cpu_start
            impl = model.blocks[0].attn.impl_name(token_ids.shape[1], model.attn_impl,  # "c": minillm.fast
                                                  length_before + token_ids.shape[1])
        finally:
            model.attn_impl = previous_impl
        event = self._record_pass(phase, step, model, token_ids, cache, length_before, start, end, impl)
        event["cpu_time_ms"] = cpu_time_s * 1e3
        if isinstance(observer, _LayerObserver):
            observer.record_layers()
        if self._wants("logits"):
            self._store("logits", step, logits[:, -1].float())
        self._last_pass = event
        return logits

    def record_sample(self, logits: torch.Tensor, token_id: int, params, time_s: float,
                      finish_reason: str | None = None, n_allowed: int | None = None) -> Event:
        """Attach the chosen next token to the latest prefill/decode event (called by generate).

        Args:
            logits: [1, vocab] float32 logits the token was sampled from.
            token_id: the chosen token.
            params: the :class:`~minillm.sampling.SamplingParams` used.
            time_s: ``time.perf_counter()`` when the token was known (its GenerationStep.time_s).
            finish_reason: None, or why generation stops after this token.
            n_allowed: with constrained decoding, how many tokens the mask allowed at this step
                (recorded as ``allowed_tokens``); None: no mask (the field is left out).
        """
        event = self._last_pass
        if event is None:
            raise ValueError("record_sample needs a traced prefill or decode pass first")
        probs = torch.softmax(logits[0].float(), dim=-1)
        top = torch.topk(probs, min(self.n_candidates, probs.shape[-1]))
        candidates = [{"token_id": int(i), "prob": float(p)} for p, i in zip(top.values, top.indices)]
        chosen_prob = probs[token_id]
        end_ms = (time_s - self.start_s) * 1e3
        event.update(
            next_token_id=int(token_id),
            next_token_prob=float(chosen_prob),
            next_token_logprob=float(torch.log(chosen_prob)),
            next_token_rank=int((probs > chosen_prob).sum()),
            candidates=candidates,
            sampling=_how(params),
            sample_ms=end_ms - event["start_ms"] - event["time_ms"],
            end_ms=end_ms,
            finish_reason=finish_reason,
        )
        if n_allowed is not None:
            event["allowed_tokens"] = int(n_allowed)
        if self.tokenizer is not None:
            texts = self.tokenizer.token_strings([token_id] + [c["token_id"] for c in candidates])
            event["next_token_text"] = texts[0]
            for c, text in zip(candidates, texts[1:]):
                c["text"] = text
        self._token_times_s.append(time_s)
        return event

    def record_metrics(self, n_prompt_tokens: int, finish_reason: str | None = None) -> Event:
        """Record the request's metrics from the token times seen by :meth:`record_sample`.

        MBU uses the mean bytes of a decode step and ``hardware`` (when set); with
        ``hardware`` set, also records the roofline verdicts (:meth:`record_roofline`).
        """
        decode = self.decode_steps
        bytes_per_step = sum(e["bytes"] for e in decode) / len(decode) if decode else None
        peak = self.hardware.mem_bandwidth if self.hardware is not None else None
        m = RequestMetrics.from_timestamps(self.start_s, self._token_times_s, n_prompt_tokens, bytes_per_step, peak)
        fields = asdict(m)
        fields["itl_ms"] = list(fields["itl_ms"])
        event = self.record("metrics", **fields, finish_reason=finish_reason)
        if self.hardware is not None:
            self.record_roofline(self.hardware)
        return event

    def record_roofline(self, hw) -> list[Event]:
        """Record one "roofline" event per phase (all prefill passes, all decode steps, summed)
        against hardware ``hw``: attained FLOP/s and bytes/s, floors and the bound verdict."""
        events = []
        for phase in PASS_KINDS:
            passes = [e for e in self.events if e["kind"] == phase]
            time_s = sum(e["time_ms"] for e in passes) / 1e3
            if not passes or time_s <= 0:
                continue
            cost = PhaseCost(sum(e["flops"] for e in passes), sum(e["bytes"] for e in passes))
            r = roofline(cost, time_s, hw)
            host = _host_load()
            if self.first("model") and self.first("model")["device"] == "cpu" and "torch_threads" in host:
                cpu_s = sum(e.get("cpu_time_ms", 0) for e in passes) / 1e3
                host["cpu_share"] = cpu_s / (time_s * host["torch_threads"])
            events.append(self.record(
                "roofline", phase=phase, n_passes=len(passes), flops=cost.flops, bytes=cost.bytes,
                time_ms=time_s * 1e3, arithmetic_intensity_flop_per_byte=r.arithmetic_intensity,
                compute_floor_ms=r.compute_floor_s * 1e3, memory_floor_ms=r.memory_floor_s * 1e3,
                floor_ms=r.floor_s * 1e3, attained_flop_per_s=r.attained_flops,
                attained_bytes_per_s=r.attained_bandwidth, roofline_fraction=r.roofline_fraction,
                bound=r.bound, explanation=r.explanation, hardware=hw.name, peak_flop_per_s=hw.peak_flops,
                peak_bytes_per_s=hw.mem_bandwidth, ridge_point_flop_per_byte=hw.ridge_point, **host,
            ))
        return events

    # -- reading --------------------------------------------------------------------------

    def of(self, kind: str) -> Events:
        """The events of one kind, in order."""
        return Events(e for e in self.events if e["kind"] == kind)

    def first(self, kind: str) -> Event | None:
        return next((e for e in self.events if e["kind"] == kind), None)

    @property
    def prefill(self) -> Event | None:
        """The (first) prefill event."""
        return self.first("prefill")

    @property
    def decode_steps(self) -> Events:
        return self.of("decode")

    @property
    def steps(self) -> Events:
        """Prefill and decode events in pass order: one per generated token under generate()."""
        return Events(e for e in self.events if e["kind"] in PASS_KINDS)

    @property
    def metrics(self) -> Event | None:
        return self.first("metrics")

    @property
    def rooflines(self) -> dict[str, Event]:
        """{"prefill": event, "decode": event} of the recorded roofline verdicts."""
        return {e["phase"]: e for e in self.of("roofline")}

    def layers(self, step: int | None = None) -> Events:
        """Layer events (level "layers"), all or of one pass."""
        return Events(e for e in self.of("layer") if step is None or e["step"] == step)

    def activation(self, name: str, step: int = 0) -> torch.Tensor:
        """A kept activation of pass ``step`` (0 = the prefill). Raises KeyError if not kept."""
        for e in self.of("activation"):
            if e["name"] == name and e["step"] == step:
                return self.activations[name][e["index"]]
        kept = sorted(self.activations) or "nothing"
        raise KeyError(f"activation {name!r} of step {step} was not kept (kept: {kept}); "
                       f"pass keep=[{name!r}] to Trace")

    # -- export ---------------------------------------------------------------------------

    def to_records(self) -> list[dict]:
        """Every event as a plain JSON-ready dict, in order."""
        return [json.loads(json.dumps(dict(e))) for e in self.events]

    def to_jsonl(self, path) -> Path:
        """Write one JSON event a line (see the module docstring for the schema)."""
        path = Path(path)
        with path.open("w") as f:
            for record in self.to_records():
                f.write(json.dumps(record) + "\n")
        return path

    @classmethod
    def from_records(cls, records) -> "Trace":
        """A trace rebuilt from records (activation tensors are not part of them)."""
        records = list(records)
        header = records[0] if records and records[0]["kind"] == "trace" else {}
        trace = cls(header.get("level", "steps"), header.get("keep", ()), header.get("n_candidates", 5))
        trace.events = Events(Event(r) for r in records)
        trace._n_passes = len(trace.steps)
        return trace

    @classmethod
    def from_jsonl(cls, path) -> "Trace":
        with Path(path).open() as f:
            return cls.from_records(json.loads(line) for line in f if line.strip())

    # -- display --------------------------------------------------------------------------

    def __repr__(self) -> str:
        m = self.metrics
        summary = f", ttft={m['ttft_ms']:.1f} ms" if m else ""
        return (f"Trace(level={self.level!r}, events={len(self.events)}, prefill={len(self.of('prefill'))}, "
                f"decode={len(self.decode_steps)}{summary})")

    # -- internals ------------------------------------------------------------------------

    def _start_clock(self) -> None:
        """Restart the request clock at the first event after the header (see the class docstring)."""
        if len(self.events) == 1 and self.events[0]["kind"] == "trace":
            self.start_s = time.perf_counter()

    def _check_same_request(self, phase: str) -> None:
        """Refuse a pass that would mix a second request into this trace's metrics."""
        if self.metrics is not None or (phase == "prefill" and self._token_times_s):
            done = "its metrics are recorded" if self.metrics is not None else "a token was already sampled"
            raise ValueError(f"this Trace already holds a request ({done}); a trace records one request: "
                             "make a new Trace() for each generate() call")

    def _observes(self) -> bool:
        return self.level == "layers" or any(k != "logits" for k in self.keep)

    def _wants(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.keep)

    def _keeps_pattern(self, n_layers: int) -> bool:
        return any(self._wants(f"blocks.{i}.attn.hook_pattern") for i in range(n_layers))

    def _store(self, name: str, step: int, tensor: torch.Tensor) -> None:
        kept = self.activations.setdefault(name, [])
        kept.append(tensor.detach().to("cpu", copy=True))  # a copy: cache views change later
        self.record("activation", step=step, name=name, index=len(kept) - 1,
                    shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."))

    def _record_model(self, model, cache) -> None:
        c = model.config
        param = next(model.parameters())
        self.record("model", n_layers=c.n_layers, d_model=c.d_model, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                    head_dim=c.head_dim, vocab_size=c.vocab_size, max_seq_len=c.max_seq_len,
                    dtype=str(param.dtype).removeprefix("torch."), device=str(param.device),
                    weights_bytes=model.weights_bytes(), kv_bytes_per_token=cache.bytes_per_token,
                    attn_impl=model.attn_impl, decode_path=getattr(model, "decode_path", None))
        self._model_recorded = True

    def _record_pass(self, phase, step, model, token_ids, cache, length_before, start, end, impl) -> Event:
        B, T = token_ids.shape
        dtype_bytes = next(model.parameters()).element_size()
        cost = prefill_cost(model.config, T, dtype_bytes, cached_tokens=length_before, batch_size=B)
        cost = with_weights_bytes(cost, model.weights_bytes())  # quantised weights move the floor
        time_s = end - start
        n_kv_heads, head_dim = cache.k.shape[2], cache.k.shape[4]
        ids = token_ids.tolist()
        fields = dict(
            step=step, start_ms=(start - self.start_s) * 1e3, time_ms=time_s * 1e3,
            end_ms=(end - self.start_s) * 1e3, batch_size=B,
        )
        if phase == "prefill":
            fields.update(
                n_tokens=T, token_ids=ids[0] if B == 1 else ids, position_first=length_before,
                position_last=length_before + T - 1, cached_tokens=length_before,
                kv_written_shape=[B, n_kv_heads, T, head_dim], kv_written_bytes=B * T * cache.bytes_per_token,
            )
        else:
            token = [row[0] for row in ids]
            fields.update(input_token_id=token[0] if B == 1 else token, position=length_before)
            if self.tokenizer is not None and B == 1:
                fields["input_token_text"] = self.tokenizer.token_strings(token)[0]
        fields.update(
            cache_length_before=length_before, cache_length_after=cache.length,
            kv_cache_shape=[B, n_kv_heads, cache.length, head_dim], kv_bytes=cache.bytes_used,
            flops=cost.flops, bytes=cost.bytes, weights_bytes=cost.weights_bytes,
            kv_read_bytes=cost.kv_read_bytes, arithmetic_intensity_flop_per_byte=cost.arithmetic_intensity,
            attained_flop_per_s=cost.flops / time_s if time_s > 0 else None,
            attained_bytes_per_s=cost.bytes / time_s if time_s > 0 else None,
            attn_impl=impl,
        )
        return self.record(phase, t_ms=fields["end_ms"], **fields)


class _LayerObserver:
    """The ``hook(name, tensor)`` a traced pass gives the model: notes shapes and per-layer
    times (level "layers"), stores kept activations, and calls the user's own hook too.

    A layer's time runs from the previous layer's ``hook_resid_post`` (or ``hook_embed``)
    to its own: attention, MLP and the K/V cache write.
    """

    def __init__(self, trace: Trace, step: int, phase: str, user_hook, device):
        self.trace, self.step, self.phase, self.user_hook, self.device = trace, step, phase, user_hook, device
        self.last_s = time.perf_counter()  # reset at hook_embed, the start of the pass
        self.embed_shape = None
        self.layers: dict[int, dict] = {}
        self.layer_level = trace.level == "layers"

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if self.user_hook is not None:
            self.user_hook(name, tensor)
        if self.trace._wants(name):
            self.trace._store(name, self.step, tensor)
        if not self.layer_level:
            return
        if name == "hook_embed":
            self.embed_shape = list(tensor.shape)
            synchronize(self.device)
            self.last_s = time.perf_counter()
            return
        match = _BLOCK_NAME.match(name)
        if not match:
            return
        layer, point = int(match[1]), match[2]
        info = self.layers.setdefault(layer, {})
        if point in _SHAPE_FIELDS:
            info[_SHAPE_FIELDS[point]] = list(tensor.shape)
        if point == "hook_resid_post":
            synchronize(self.device)
            now = time.perf_counter()
            info["start_ms"] = (self.last_s - self.trace.start_s) * 1e3
            info["time_ms"] = (now - self.last_s) * 1e3
            self.last_s = now

    def record_layers(self) -> None:
        previous_resid = self.embed_shape
        for layer in sorted(self.layers):
            info = self.layers[layer]
            self.trace.record(
                "layer", step=self.step, phase=self.phase, layer=layer, name=f"blocks.{layer}",
                start_ms=info.get("start_ms"), time_ms=info.get("time_ms"),
                attn_in_shape=previous_resid, q_shape=info.get("q_shape"),
                k_shape=info.get("k_shape"), v_shape=info.get("v_shape"),
                k_cache_shape=info.get("k_cache_shape"), v_cache_shape=info.get("v_cache_shape"),
                attn_out_shape=info.get("attn_out_shape"), mlp_in_shape=info.get("attn_out_shape"),
                mlp_out_shape=info.get("mlp_out_shape"), resid_post_shape=info.get("resid_post_shape"),
            )
            previous_resid = info.get("resid_post_shape")


_BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.(?:attn\.)?(hook_\w+)$")
_SHAPE_FIELDS = {
    "hook_q": "q_shape", "hook_k": "k_shape", "hook_v": "v_shape",
    "hook_k_cache": "k_cache_shape", "hook_v_cache": "v_cache_shape",
    "hook_attn_out": "attn_out_shape", "hook_mlp_out": "mlp_out_shape", "hook_resid_post": "resid_post_shape",
}


def _check_args(keep, n_candidates, tokenizer, hardware) -> None:
    """The Trace arguments that would otherwise fail only later, deep inside a pass."""
    if not all(isinstance(k, str) for k in keep):
        raise ValueError(f"keep must be activation names or glob patterns (str), got {list(keep)!r}")
    if isinstance(n_candidates, bool) or not isinstance(n_candidates, int) or n_candidates < 0:
        raise ValueError(f"n_candidates must be an int >= 0, got {n_candidates!r}")
    if tokenizer is not None and not hasattr(tokenizer, "token_strings"):
        raise ValueError(f"tokenizer must be minillm's (load_tokenizer), got {type(tokenizer).__name__}: "
                         "the trace needs its token_strings()")
    if hardware is not None and not hasattr(hardware, "mem_bandwidth"):
        raise ValueError(f"hardware must be a HardwareProfile (minillm.hardware.get_hardware), "
                         f"got {type(hardware).__name__}")


def _how(params) -> dict:
    """How a token was chosen, as recorded in the "sampling" field (min_p and penalties only when set)."""
    defaults = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    extras = {k: getattr(params, k) for k, off in defaults.items() if getattr(params, k) != off}
    if params.greedy:
        return {"method": "greedy", **extras}
    return {"method": "sampled", "temperature": params.temperature, "top_k": params.top_k,
            "top_p": params.top_p, "seed": params.seed, **extras}


def _host_load() -> dict:
    """How busy the machine was (other processes stretch measured times): the 1-minute
    load average, the CPU count and the threads torch uses; {} where unknown."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return {}
    return {"load_average_1m": load, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that the clock reads real time (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _short(value, limit: int = 80) -> str:
    text = fmt_num(value, 4) if isinstance(value, float) else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
