"""Benchmarks: minillm next to transformers, a no-KV-cache baseline and the hardware's floors.

Engines, all greedy, all on the same weights in the same process:

    engine           prefill (TTFT)                    decode (TPOT)
    minillm-sdpa     prefill() of the prompt           decode_step() over the KV cache
    minillm-eager    the same, attention written out
    minillm-compile  (--compile) the same, decode_step compiled (minillm.compile)
    transformers     generate(max_new_tokens=1)        generate() continuing its KV cache
    no-cache         one forward pass (the same)       a forward pass over the whole sequence
                                                       for every token (minillm.baseline)

Method, so that a noisy machine affects every engine alike:

- every case (phase, length, batch) is run ``repeats`` times; within a repeat the
  engines take turns, in an order that rotates from repeat to repeat;
- a prefill case times prompt -> first token (TTFT) from an empty cache;
- a decode case fills the cache with the first length-1 prompt tokens once (untimed);
  each repeat cuts the cache back to that, feeds the last prompt token and times the
  gaps between the next ``decode_tokens`` tokens; TPOT is the median gap;
- a decode batch of B holds B copies of one prompt, so each engine prefills one row
  and copies its K/V to the others (a step costs the same whatever the rows hold, and
  the untimed set-up is B times shorter);
- each engine's number is the median over the repeats; the spread is kept too.

The floors come from the cost model (:mod:`minillm.costs`) and the calibrated peaks
(:func:`minillm.hardware.get_hardware`), via :func:`minillm.hardware.roofline`:

    prefill floor = FLOPs / peak FLOP/s                            (compute-bound)
    decode floor  = (weights + KV read + KV written) bytes / GB/s   (memory-bound)

``floor_fraction`` = floor / measured time: 1.0 would be at the roof.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .baseline import generate_no_cache
from .costs import decode_cost, prefill_cost
from .hardware import HardwareProfile, get_hardware, load_calibration, roofline
from .kv_cache import KVCache
from .model import Transformer
from .phases import decode_step, prefill

ENGINES = ("minillm-sdpa", "minillm-eager", "transformers", "no-cache")
REFERENCE = "transformers"  # the ratios column divides by this engine
BEATEN_FLOOR = 1.05  # a measurement this far past its floor means the calibrated peaks are wrong
NO_CACHE_POSITIONS = 2048  # no-cache decode: about this many positions per token-run, see _no_cache_tokens
MEMORY_OVERHEAD_BYTES = 300 * 10**6  # the memory target: weights + KV cache + this
MEMORY_PROMPT_TOKENS = 16  # the prompt of the peak-memory run


# -- results ----------------------------------------------------------------------------


@dataclass
class Measurement:
    """One engine on one case, medians over the repeats.

    Attributes:
        engine: "minillm-sdpa", "transformers", ...
        phase: "prefill" (time_ms is TTFT) or "decode" (time_ms is TPOT).
        length: prompt tokens (prefill) or tokens in the cache when decoding starts (decode).
        batch_size: sequences per forward pass.
        time_ms: median over repeats of TTFT (prefill) or of each repeat's median gap (decode), ms.
        times_ms: the per-repeat values, ms.
        tokens_per_s: batch_size·length / TTFT (prefill), batch_size / TPOT (decode).
        decode_tokens: tokens generated per repeat (1 for prefill).
        floor_ms: the roofline floor of the same work (compute for prefill, memory for decode), ms.
        floor_fraction: floor_ms / time_ms (1 = at the hardware's limit).
        bound: the roofline verdict ("compute-bound", "memory-bound", "overhead-bound").
        vs_reference: tokens_per_s / transformers' tokens_per_s in the same case (None without it).
        same_tokens: the greedy tokens equal minillm-sdpa's in the same case (None when not compared).
    """

    engine: str
    phase: str
    length: int
    batch_size: int
    time_ms: float
    times_ms: list[float]
    tokens_per_s: float
    decode_tokens: int
    floor_ms: float
    floor_fraction: float
    bound: str
    vs_reference: float | None = None
    same_tokens: bool | None = None


@dataclass
class MemoryReport:
    """Peak resident memory of ``minillm generate``-ing n_tokens, measured in a fresh process.

    Attributes:
        n_tokens, prompt_tokens: the request.
        weights_bytes: the model's parameters.
        kv_cache_bytes: the KV cache allocated for prompt + n_tokens positions.
        import_rss_bytes: RSS after ``import torch, minillm`` (the runtime itself).
        process_peak_bytes: peak RSS over the whole process (loading included).
        generate_peak_bytes: peak RSS from the end of loading to the last token
            (Linux: peak counter reset through /proc/self/clear_refs; else = process peak).
        budget_bytes: weights + KV cache + 300 MB, the target for generate_peak_bytes.
        device_peak_bytes: on CUDA, ``torch.cuda.max_memory_allocated`` (RSS does not see GPU memory).
    """

    n_tokens: int
    prompt_tokens: int
    weights_bytes: int
    kv_cache_bytes: int
    import_rss_bytes: int
    process_peak_bytes: int
    generate_peak_bytes: int
    budget_bytes: int
    device_peak_bytes: int | None = None

    @property
    def within_budget(self) -> bool:
        return self.generate_peak_bytes <= self.budget_bytes


@dataclass
class TargetCheck:
    """One target of the benchmark issue, checked against the measured numbers."""

    name: str
    measured: float | None
    target: float
    met: bool | None  # None: not measured in this run
    detail: str


@dataclass
class BenchResult:
    """Everything one ``run_bench`` measured, plus what it was measured on."""

    model: str
    device: str
    dtype: str
    threads: int
    hardware: HardwareProfile
    weights_bytes: int
    kv_bytes_per_token: int
    repeats: int
    measurements: list[Measurement]
    memory: MemoryReport | None = None
    notes: list[str] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    wall_s: float = 0.0

    def find(self, engine: str, phase: str, length: int, batch_size: int = 1) -> Measurement | None:
        """The measurement of one engine on one case, or None."""
        for m in self.measurements:
            if (m.engine, m.phase, m.length, m.batch_size) == (engine, phase, length, batch_size):
                return m
        return None

    def engines(self) -> list[str]:
        return list(dict.fromkeys(m.engine for m in self.measurements))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = [asdict(t) for t in check_targets(self)]
        if self.memory is not None:
            d["memory"]["within_budget"] = self.memory.within_budget
        return d

    def to_json(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path


# -- engines ----------------------------------------------------------------------------
#
# Each engine offers the same three calls; ids are [B, L] int64 on the model's device.
#   ttft(ids)                       -> Clock: prompt -> first token, from an empty cache
#   prepare_decode(ids, n)          -> state: the first L-1 tokens' K/V in a cache (untimed;
#                                      the rows of ids are equal: one is prefilled, then copied)
#   decode(ids, state, n)           -> Clock: the last prompt token, then n tokens in all


class Clock:
    """Arrival time of each new token, called with the token [B] once it is on the host."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[list[int]] = []  # [n][B]

    def __call__(self, token: torch.Tensor) -> None:
        self.tokens.append(token.reshape(-1).tolist())  # .tolist() waits for the device
        self.times.append(time.perf_counter())

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.start

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]


class MiniLLMEngine:
    """minillm's prefill + decode_step with greedy argmax (what ``generate`` does at temperature 0).

    ``step`` replaces decode_step (the compiled one, for minillm-compile).
    """

    def __init__(self, model: Transformer, attn_impl: str = "sdpa", name: str | None = None, step=None):
        self.model, self.attn_impl = model, attn_impl
        self.name = name or f"minillm-{attn_impl}"
        self.step = step or decode_step
        self.compiled = step is not None  # compiles once per cache shape: warm each case up untimed

    def ttft(self, ids: torch.Tensor) -> Clock:
        self.model.attn_impl = self.attn_impl
        clock = Clock()
        cache = KVCache.for_model(self.model, batch_size=ids.shape[0], max_seq_len=ids.shape[1] + 1)
        clock(prefill(self.model, ids, cache).argmax(dim=-1))
        return clock

    def prepare_decode(self, ids: torch.Tensor, n_new: int) -> KVCache:
        self.model.attn_impl = self.attn_impl
        batch, length = ids.shape
        row = KVCache.for_model(self.model, batch_size=1, max_seq_len=length + n_new)
        prefill(self.model, ids[:1, :-1], row)
        if batch == 1:
            return row
        cache = KVCache.for_model(self.model, batch_size=batch, max_seq_len=length + n_new)
        cache.k.copy_(row.k.expand_as(cache.k))  # [n_layers, 1, ...] -> every row of the batch
        cache.v.copy_(row.v.expand_as(cache.v))
        cache.advance(row.length)
        return cache

    def decode(self, ids: torch.Tensor, cache: KVCache, n_new: int) -> Clock:
        self.model.attn_impl = self.attn_impl
        cache.truncate(ids.shape[1] - 1)
        clock = Clock()
        token = prefill(self.model, ids[:, -1:], cache).argmax(dim=-1)
        clock(token)
        for _ in range(n_new - 1):
            token = self.step(self.model, token, cache).argmax(dim=-1)
            clock(token)
        return clock


class NoCacheEngine:
    """The nanoGPT-style sampler of :mod:`minillm.baseline`: no KV cache at all."""

    name = "no-cache"

    def __init__(self, model: Transformer):
        self.model = model

    def ttft(self, ids: torch.Tensor) -> Clock:
        self.model.attn_impl = "sdpa"
        clock = Clock()
        generate_no_cache(self.model, ids, 1, on_token=clock)
        return clock

    def prepare_decode(self, ids: torch.Tensor, n_new: int) -> None:
        return None  # nothing to keep: every token starts from scratch

    def decode(self, ids: torch.Tensor, state, n_new: int) -> Clock:
        self.model.attn_impl = "sdpa"
        clock = Clock()
        generate_no_cache(self.model, ids, n_new, on_token=clock)
        return clock


class TransformersEngine:
    """Hugging Face ``generate`` (greedy, its DynamicCache on) on the same checkpoint."""

    name = "transformers"

    def __init__(self, hf_model):
        self.hf = hf_model

    def ttft(self, ids: torch.Tensor) -> Clock:
        clock = Clock()
        self._generate(ids, 1, clock)
        return clock

    def prepare_decode(self, ids: torch.Tensor, n_new: int):
        from transformers import DynamicCache

        cache = DynamicCache()
        self._generate(ids[:1, :-1], 1, None, cache)  # fills the cache with the first L-1 tokens of one row
        if ids.shape[0] > 1:
            cache.batch_repeat_interleave(ids.shape[0])  # ... and copies them to every row
        return cache

    def decode(self, ids: torch.Tensor, cache, n_new: int) -> Clock:
        extra = cache.get_seq_length() - (ids.shape[1] - 1)
        if extra > 0:
            cache.crop(-extra)  # negative: "drop this many" in transformers 4.x and 5.x alike
        clock = Clock()
        self._generate(ids, n_new, clock, cache)
        return clock

    def _generate(self, ids, n_new: int, clock: Clock | None, cache=None):
        import warnings

        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        kwargs = {} if cache is None else {"past_key_values": cache}
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # past_key_values is being renamed; both work
            # An explicit mask: without one, transformers masks every prompt token equal to pad_token_id.
            return self.hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                    streamer=_Streamer(clock) if clock else None, **kwargs)


class _Streamer:
    """transformers' streamer interface: put(prompt) once, then put(tokens [B]) per step."""

    def __init__(self, clock: Clock):
        self.clock, self.seen_prompt = clock, False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            self.clock(value)
        self.seen_prompt = True

    def end(self) -> None:
        pass


def load_transformers(model: Transformer):
    """The same checkpoint in transformers (sdpa attention, same dtype and device).

    Raises ImportError without transformers, ValueError when the model has no source folder.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    source = getattr(model, "source", None)
    if source is None:
        raise ValueError("the model has no source folder (model.source) for transformers to load")
    param = next(model.parameters())
    hf_logging.disable_progress_bar()  # its "Loading weights" bar would interleave with the bench's lines
    try:
        hf = AutoModelForCausalLM.from_pretrained(source, dtype=param.dtype, attn_implementation="sdpa")
    finally:
        hf_logging.enable_progress_bar()
    return hf.to(param.device).eval().requires_grad_(False)


def make_engines(model: Transformer, names=ENGINES, hf_model=None, compile_mode: str | None = None):
    """Build the named engines; returns (engines, notes) where notes say what was skipped and why.

    ``hf_model``: a transformers model to use as the "transformers" engine (default:
    :func:`load_transformers`). ``compile_mode``: also build "minillm-compile"
    (``torch.compile`` mode, e.g. "default" or "reduce-overhead").
    """
    names = list(names)
    if compile_mode is not None and "minillm-compile" not in names:
        names.insert(names.index("minillm-sdpa") + 1 if "minillm-sdpa" in names else 0, "minillm-compile")
    engines, notes = [], []
    for name in names:
        if name in ("minillm-sdpa", "minillm-eager"):
            engines.append(MiniLLMEngine(model, name.removeprefix("minillm-")))
        elif name == "minillm-compile":
            from .compile import compile_decode_step

            step = compile_decode_step(mode=compile_mode or "default")
            engines.append(MiniLLMEngine(model, "sdpa", name="minillm-compile", step=step))
        elif name == "no-cache":
            engines.append(NoCacheEngine(model))
        elif name == "transformers":
            try:
                engines.append(TransformersEngine(hf_model if hf_model is not None else load_transformers(model)))
            except ImportError:
                notes.append("transformers is not installed: its engine was skipped (pip install transformers)")
        else:
            raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}, minillm-compile")
    return engines, notes


# -- running ------------------------------------------------------------------------------


def run_bench(
    model: Transformer,
    prompt_lengths=(128, 512, 2048),
    context_lengths=(128, 1024),
    batch_sizes=(1, 8),
    repeats: int = 3,
    decode_tokens: int = 16,
    engines=ENGINES,
    compile_mode: str | None = None,
    hardware: HardwareProfile | None = None,
    hf_model=None,
    memory_tokens: int = 1024,
    model_name: str | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Measure prefill and decode of every engine, interleaved; see the module docstring.

    Args:
        model: a loaded minillm model (its ``source`` folder is what transformers loads).
        prompt_lengths: prefill cases, batch 1 (tokens).
        context_lengths: decode cases (tokens already in the cache), at every batch size.
        batch_sizes: decode batch sizes; no-cache decode is skipped where one token
            would re-run more than 2·NO_CACHE_POSITIONS positions.
        repeats: runs per case and engine (medians are reported).
        decode_tokens: tokens generated per decode run (>= 2); the no-cache engine makes fewer.
        engines: names from ENGINES; ``compile_mode`` adds "minillm-compile".
        hardware: the peaks for the floors; default the calibration of the model's
            device and dtype (measured now if missing, a few seconds).
        hf_model: the transformers model (default: loaded from ``model.source``).
        memory_tokens: also measure the peak RSS of generating this many tokens in a
            fresh process (0: skip).
        seed: for the random prompt ids.
        progress: called with a short line before each step (the CLI prints them).

    Returns a :class:`BenchResult`. Raises ValueError for lengths < 2, repeats < 1 or
    decode_tokens < 2, or lengths beyond the model's context.
    """
    start = time.perf_counter()
    say = progress or (lambda line: None)
    validate_bench(model, prompt_lengths, context_lengths, batch_sizes, repeats, decode_tokens, memory_tokens)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if hardware is None and load_calibration(device, dtype) is None:
        say(f"calibrating {device} in {str(dtype).removeprefix('torch.')} (first run; cached for the next)")
    hw = hardware or get_hardware(device, dtype)
    say("loading engines")
    built, notes = make_engines(model, engines, hf_model, compile_mode)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size

    def prompt(batch, length):  # random ids: speed does not depend on what the tokens say
        return torch.randint(0, vocab, (batch, length), generator=gen).to(device)

    say("warming up")
    _warm_up(built, prompt(1, 16))

    measurements, tokens = [], {}  # tokens: id(measurement) -> the first repeat's greedy tokens
    for length in prompt_lengths:
        say(f"prefill {length} tokens")
        ids = prompt(1, length)
        runs = _interleave(built, repeats, lambda e: e.ttft(ids))
        for e in built:
            measurements.append(_prefill_measurement(model, hw, e.name, length, runs[e.name]))
            tokens[id(measurements[-1])] = runs[e.name][0].tokens
    for batch in batch_sizes:
        for length in context_lengths:
            say(f"decode at context {length}, batch {batch}")
            runs = _decode_case(built, prompt(1, length).repeat(batch, 1), repeats, decode_tokens, notes)
            for name, clocks in runs.items():
                measurements.append(_decode_measurement(model, hw, name, length, batch, clocks))
                tokens[id(measurements[-1])] = clocks[0].tokens
    _add_comparisons(measurements, tokens)
    notes += _no_cache_notes(built, context_lengths, decode_tokens)
    notes += _beaten_floor_notes(measurements, hw)

    memory = None
    if memory_tokens and getattr(model, "source", None) is None:
        notes.append("peak memory not measured: the model has no source folder to load in a fresh process")
    elif memory_tokens:
        say(f"peak memory of generating {memory_tokens} tokens (fresh process)")
        memory = measure_peak_memory(model, memory_tokens, MEMORY_PROMPT_TOKENS, threads=torch.get_num_threads())

    return BenchResult(
        model=model_name or str(getattr(model, "source", "model")),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        hardware=hw,
        weights_bytes=model.weights_bytes(),
        kv_bytes_per_token=model.config.kv_bytes_per_token(param.element_size()),
        repeats=repeats,
        measurements=measurements,
        memory=memory,
        notes=notes,
        versions=_versions(),
        wall_s=time.perf_counter() - start,
    )


def validate_bench(model, prompt_lengths, context_lengths, batch_sizes, repeats, decode_tokens,
                   memory_tokens: int = 0) -> None:
    """The checks :func:`run_bench` makes before any work; raises ValueError naming the bad value."""
    limit = model.config.max_seq_len
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if decode_tokens < 2:
        raise ValueError(f"decode_tokens must be >= 2 (TPOT needs two tokens), got {decode_tokens}")
    for length in prompt_lengths:
        if not 2 <= length <= limit - 1:
            raise ValueError(f"prompt length {length} must be in [2, {limit - 1}] (the model's context)")
    for length in context_lengths:
        if not 2 <= length <= limit - decode_tokens:
            raise ValueError(f"context length {length} + {decode_tokens} decode tokens must fit in [2, {limit}]")
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if not 0 <= memory_tokens <= limit - MEMORY_PROMPT_TOKENS:
        raise ValueError(f"memory tokens must be in [0, {limit - MEMORY_PROMPT_TOKENS}] "
                         f"({MEMORY_PROMPT_TOKENS} prompt tokens + them fit the model's context), got {memory_tokens}")


def _warm_up(engines, ids: torch.Tensor) -> None:
    """One small untimed run per engine: first-call costs (allocator, kernels, compilation)."""
    for e in engines:
        e.ttft(ids)
        e.decode(ids, e.prepare_decode(ids, 4), 4)


def _interleave(engines, repeats: int, run) -> dict[str, list[Clock]]:
    """``run(engine)`` for every engine, ``repeats`` times, the order rotated each repeat."""
    clocks = {e.name: [] for e in engines}
    for r in range(repeats):
        k = r % max(len(engines), 1)
        for e in engines[k:] + engines[:k]:
            clocks[e.name].append(run(e))
    return clocks


def _decode_case(engines, ids: torch.Tensor, repeats: int, decode_tokens: int, notes: list) -> dict[str, list[Clock]]:
    """One decode case, ids [B, L]: each engine fills its cache once (untimed), then the
    engines take turns decoding from it. Returns the clocks per engine name."""
    batch, length = ids.shape
    active, plan = [], {}
    for e in engines:
        n_new = _no_cache_tokens(batch, length, decode_tokens) if e.name == "no-cache" else decode_tokens
        if n_new is None:
            notes.append(f"no-cache decode skipped at batch {batch}, context {length}: each token "
                         f"would re-run {batch * length} positions")
            continue
        plan[e.name] = (e.prepare_decode(ids, n_new), n_new)
        if getattr(e, "compiled", False):
            e.decode(ids, plan[e.name][0], 2)  # this cache shape's compilation, untimed
        active.append(e)
    return _interleave(active, repeats, lambda e: e.decode(ids, *plan[e.name]))


def _no_cache_notes(engines, context_lengths, decode_tokens: int) -> list[str]:
    if "no-cache" not in [e.name for e in engines]:
        return []
    notes = []
    for length in context_lengths:
        short = _no_cache_tokens(1, length, decode_tokens)
        if short is not None and short < decode_tokens:
            notes.append(f"no-cache decode at context {length} made {short} tokens per run (not {decode_tokens}) "
                         f"to keep the run short; each costs a forward pass over ~{length} positions")
    return notes


def _beaten_floor_notes(measurements: list[Measurement], hw: HardwareProfile) -> list[str]:
    beaten = [m for m in measurements if m.floor_fraction > BEATEN_FLOOR]
    if not beaten:
        return []
    worst = max(beaten, key=lambda m: m.floor_fraction)
    return [f"{len(beaten)} measurements ran faster than their floor ({worst.engine} {worst.phase} {worst.length}: "
            f"{100 * worst.floor_fraction:.0f}%): the calibration ({hw.peak_flops / 1e9:,.1f} GFLOP/s, "
            f"{hw.mem_bandwidth / 1e9:,.1f} GB/s) understates this device and dtype, so the floor targets are "
            "not judged; run `minillm calibrate` again"]


def _no_cache_tokens(batch: int, length: int, decode_tokens: int) -> int | None:
    """How many tokens the no-cache engine makes per decode run: ~NO_CACHE_POSITIONS
    positions' worth, at least 2; None (skip) when one token alone re-runs more than twice that."""
    positions = batch * length
    if positions > 2 * NO_CACHE_POSITIONS:
        return None
    return max(2, min(decode_tokens, NO_CACHE_POSITIONS // positions))


def _prefill_measurement(model, hw, engine: str, length: int, clocks: list[Clock]) -> Measurement:
    times = [c.ttft_s for c in clocks]
    t = statistics.median(times)
    cost = prefill_cost(model.config, length, next(model.parameters()).element_size())
    verdict = roofline(cost, t, hw)
    return Measurement(engine, "prefill", length, 1, t * 1e3, [x * 1e3 for x in times], length / t, 1,
                       verdict.floor_s * 1e3, verdict.roofline_fraction, verdict.bound)


def _decode_measurement(model, hw, engine: str, length: int, batch: int, clocks: list[Clock]) -> Measurement:
    times = [statistics.median(c.gaps_s) for c in clocks]
    t = statistics.median(times)
    n_new = len(clocks[0].times)
    # The timed steps attend to length+1 .. length+n_new-1 keys: cost at the middle one.
    cost = decode_cost(model.config, length + n_new // 2, next(model.parameters()).element_size(), batch)
    verdict = roofline(cost, t, hw)
    return Measurement(engine, "decode", length, batch, t * 1e3, [x * 1e3 for x in times], batch / t, n_new,
                       verdict.floor_s * 1e3, verdict.roofline_fraction, verdict.bound)


def _add_comparisons(measurements: list[Measurement], tokens: dict[int, list]) -> None:
    """Fill vs_reference (tok/s over transformers') and same_tokens (vs minillm-sdpa's greedy
    tokens; ``tokens`` maps id(measurement) to its [n][B] tokens)."""
    by_case = {}
    for m in measurements:
        by_case.setdefault((m.phase, m.length, m.batch_size), {})[m.engine] = m
    for case in by_case.values():
        ref, sdpa = case.get(REFERENCE), case.get("minillm-sdpa")
        for m in case.values():
            if ref is not None:
                m.vs_reference = m.tokens_per_s / ref.tokens_per_s
            if sdpa is not None and m is not sdpa:
                mine, theirs = tokens[id(m)], tokens[id(sdpa)]
                n = min(len(mine), len(theirs))  # the no-cache engine may make fewer
                m.same_tokens = mine[:n] == theirs[:n]


def _versions() -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


# -- targets ----------------------------------------------------------------------------------


def check_targets(result: BenchResult, engine: str = "minillm-sdpa") -> list[TargetCheck]:
    """The issue's targets (batch 1) against this run's numbers; unmeasured ones have met=None."""
    checks = []
    decodes = [m for m in result.measurements if m.engine == engine and m.phase == "decode" and m.batch_size == 1]
    for m in decodes:
        checks.append(_check(f"decode ctx {m.length}: x transformers", m.vs_reference, 1.5, "tok/s ratio, same run"))
        checks.append(_floor_check(f"decode ctx {m.length}: fraction of floor", m,
                                   f"floor {m.floor_ms:.1f} ms (bytes / GB/s), measured {m.time_ms:.1f} ms"))
    pre = result.find(engine, "prefill", 512)
    if pre is not None:
        checks.append(_check("prefill 512: x transformers", pre.vs_reference, 1.0, "tok/s ratio, same run"))
        checks.append(_floor_check("prefill 512: fraction of floor", pre,
                                   f"floor {pre.floor_ms:.0f} ms (FLOPs / FLOP/s), measured {pre.time_ms:.0f} ms"))
    if result.memory is not None:
        mem = result.memory
        checks.append(TargetCheck("memory: peak RSS generating (MB)", mem.generate_peak_bytes / 1e6,
                                  mem.budget_bytes / 1e6, mem.within_budget,
                                  "budget = weights + KV cache + 300 MB"))
    slow = cache_slowdowns(result)
    if len(slow) >= 2:
        lengths = sorted(slow)
        grows = all(slow[a] < slow[b] for a, b in zip(lengths, lengths[1:]))
        detail = ", ".join(f"ctx {n}: {slow[n]:.1f}x" for n in lengths)
        checks.append(TargetCheck("no-cache slowdown grows with context", slow[lengths[-1]], slow[lengths[0]],
                                  grows, detail))
    # The decode target again for the compiled step (3x on a CUDA GPU, 1.5x elsewhere).
    on_cuda = result.device.startswith("cuda")
    for m in result.measurements:
        if m.engine == "minillm-compile" and m.phase == "decode" and m.batch_size == 1:
            checks.append(_check(f"{'cuda ' if on_cuda else ''}decode ctx {m.length} (--compile): x transformers",
                                 m.vs_reference, 3.0 if on_cuda else 1.5, "tok/s ratio, same run"))
    return checks


def _check(name: str, value: float | None, target: float, detail: str) -> TargetCheck:
    return TargetCheck(name, value, target, None if value is None else value >= target, detail)


def _floor_check(name: str, m: Measurement, detail: str) -> TargetCheck:
    """The >= 60%-of-floor target; not judged when the floor itself was beaten (a bad calibration)."""
    if m.floor_fraction > BEATEN_FLOOR:
        return TargetCheck(name, m.floor_fraction, 0.6, None, detail + "; faster than the floor: recalibrate")
    return _check(name, m.floor_fraction, 0.6, detail)


def cache_slowdowns(result: BenchResult) -> dict[int, float]:
    """No-cache TPOT / minillm-sdpa TPOT per context length (batch 1): what the KV cache saves."""
    out = {}
    for m in result.measurements:
        if m.engine == "no-cache" and m.phase == "decode" and m.batch_size == 1:
            cached = result.find("minillm-sdpa", "decode", m.length, 1)
            if cached is not None:
                out[m.length] = m.time_ms / cached.time_ms
    return out


# -- memory -----------------------------------------------------------------------------------


def measure_peak_memory(model: Transformer, n_tokens: int = 1024, prompt_tokens: int = MEMORY_PROMPT_TOKENS,
                        threads: int | None = None) -> MemoryReport:
    """Peak RSS of generating n_tokens greedily with ``generate``, in a fresh Python process.

    A fresh process, so that nothing this one loaded (transformers, other engines)
    is counted. Raises RuntimeError if the child fails.
    """
    param = next(model.parameters())
    args = dict(source=str(model.source), n_tokens=n_tokens, prompt_tokens=prompt_tokens,
                device=str(param.device), dtype=str(param.dtype).removeprefix("torch."), threads=threads)
    code = f"from minillm.bench import _peak_memory_child; _peak_memory_child(**{args!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"peak-memory child failed: {r.stderr.strip().splitlines()[-1:]}")
    return MemoryReport(**json.loads(r.stdout.strip().splitlines()[-1]))


def _peak_memory_child(source, n_tokens, prompt_tokens, device, dtype, threads=None) -> None:
    """Runs in the child process: load, reset the peak counter, generate, print a JSON MemoryReport."""
    from .generate import generate
    from .loading import load_model
    from .sampling import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    import_rss = _rss_bytes("VmRSS")
    model = load_model(source, device=device, dtype=dtype)
    cache = KVCache.for_model(model, max_seq_len=prompt_tokens + n_tokens)
    load_peak = _rss_bytes("VmHWM")  # (not ru_maxrss: Linux carries that over from the parent across fork + exec)
    reset = _reset_peak_rss()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    for _ in generate(model, ids, SamplingParams(max_new_tokens=n_tokens), cache=cache, eos_token_ids=[]):
        pass
    if reset:
        generate_peak = _rss_bytes("VmHWM")
        process_peak = max(load_peak, generate_peak)
    else:  # no /proc (macOS): only the whole process's peak is known (ru_maxrss: bytes there)
        import resource

        generate_peak = process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    weights, kv = model.weights_bytes(), cache.bytes_capacity
    print(json.dumps(dict(
        n_tokens=n_tokens, prompt_tokens=prompt_tokens, weights_bytes=weights, kv_cache_bytes=kv,
        import_rss_bytes=import_rss, process_peak_bytes=process_peak, generate_peak_bytes=generate_peak,
        budget_bytes=weights + kv + MEMORY_OVERHEAD_BYTES,
        device_peak_bytes=torch.cuda.max_memory_allocated() if device.startswith("cuda") else None,
    )))


def _rss_bytes(field_name: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process from /proc/self/status, bytes (0 if unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _rss_bytes("VmHWM") > 0
    except OSError:
        return False


# -- rendering ----------------------------------------------------------------------------------


COLUMNS = ("phase", "length", "batch", "engine", "TTFT/TPOT ms", "tok/s", "x transformers",
           "floor ms", "% of floor", "bound", "same tokens")


def table_rows(result: BenchResult) -> list[list[str]]:
    """One row of strings per measurement, in COLUMNS order (for the rich table and markdown)."""
    rows = []
    for m in result.measurements:
        spread = f" ({min(m.times_ms):.1f}-{max(m.times_ms):.1f})" if len(m.times_ms) > 1 else ""
        rows.append([
            m.phase, str(m.length), str(m.batch_size), m.engine,
            f"{m.time_ms:.1f}{spread}", f"{m.tokens_per_s:,.1f}",
            "-" if m.vs_reference is None else f"{m.vs_reference:.2f}x",
            f"{m.floor_ms:.1f}", f"{100 * m.floor_fraction:.0f}%", m.bound,
            {None: "-", True: "yes", False: "no"}[m.same_tokens],
        ])
    return rows


def machine_line(result: BenchResult) -> str:
    hw = result.hardware
    return (f"{result.model}, {result.dtype} on {hw.name}, {result.threads} threads; "
            f"peaks {hw.peak_flops / 1e9:,.1f} GFLOP/s, {hw.mem_bandwidth / 1e9:,.1f} GB/s; "
            f"weights {result.weights_bytes / 1e6:,.0f} MB; {result.repeats} repeat{'s' if result.repeats != 1 else ''}, medians; "
            f"{', '.join(f'{k} {v}' for k, v in result.versions.items())}")


def rich_table(result: BenchResult):
    """The measurements as a ``rich.table.Table`` (the CLI prints it)."""
    from rich.table import Table

    table = Table(title=machine_line(result), title_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("phase", "engine", "bound") else "right")
    ms = result.measurements
    for i, (m, row) in enumerate(zip(ms, table_rows(result))):
        last_of_case = i + 1 == len(ms) or _case(ms[i + 1]) != _case(m)
        table.add_row(*row, end_section=last_of_case)
    return table


def _case(m: Measurement) -> tuple:
    return m.phase, m.length, m.batch_size


def targets_rich_table(result: BenchResult):
    """The targets as a ``rich.table.Table``; None when this run measured none of them."""
    from rich.table import Table

    if not check_targets(result):
        return None
    table = Table(title="targets (batch 1, minillm-sdpa unless named)", title_justify="left")
    for col in ("target", "measured", "needed", "met", "detail"):
        table.add_column(col)
    for t in check_targets(result):
        measured = "-" if t.measured is None else f"{t.measured:.2f}"
        met = {None: "not measured", True: "[green]yes[/green]", False: "[red]no[/red]"}[t.met]
        table.add_row(t.name, measured, f">= {t.target:.2f}" if "memory" not in t.name else f"<= {t.target:.0f}",
                      met, t.detail)
    return table


def to_markdown(result: BenchResult) -> str:
    """The measurements, targets and memory as markdown tables (for BENCHMARKS.md)."""
    lines = [f"Measured: {machine_line(result)}; {result.wall_s:.0f} s.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    lines += ["", "| target | measured | needed | met | detail |", "|---|---|---|---|---|"]
    for t in check_targets(result):
        measured = "-" if t.measured is None else f"{t.measured:.2f}"
        needed = f"<= {t.target:.0f}" if "memory" in t.name else f">= {t.target:.2f}"
        met = {None: "not measured", True: "yes", False: "**no**"}[t.met]
        lines.append(f"| {t.name} | {measured} | {needed} | {met} | {t.detail} |")
    if result.memory is not None:
        lines += ["", memory_line(result.memory)]
    lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def memory_line(mem: MemoryReport) -> str:
    mb = lambda n: f"{n / 1e6:,.0f} MB"  # noqa: E731
    line = (f"Memory, generating {mem.n_tokens} tokens (fresh process): peak RSS {mb(mem.generate_peak_bytes)} "
            f"while generating, {mb(mem.process_peak_bytes)} over the whole process (loading included); "
            f"budget {mb(mem.budget_bytes)} = weights {mb(mem.weights_bytes)} + KV cache {mb(mem.kv_cache_bytes)} "
            f"+ 300 MB; Python + torch alone: {mb(mem.import_rss_bytes)}.")
    if mem.device_peak_bytes is not None:
        line += f" GPU peak allocated: {mb(mem.device_peak_bytes)}."
    return line


def plot(result: BenchResult, path) -> Path:
    """tok/s against length per engine (prefill left, decode right), the floors dashed; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, phase in zip(axes, ("prefill", "decode")):
        ms = [m for m in result.measurements if m.phase == phase]
        for batch in sorted({m.batch_size for m in ms}):
            style = "-" if batch == 1 else "--"
            for i, engine in enumerate(result.engines()):
                pts = sorted((m.length, m.tokens_per_s) for m in ms if m.engine == engine and m.batch_size == batch)
                if pts:
                    label = engine if batch == 1 else f"{engine}, batch {batch}"
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=label)
            floor = sorted({(m.length, m.batch_size * (m.length if phase == "prefill" else 1) / m.floor_ms * 1e3)
                            for m in ms if m.batch_size == batch})
            if floor:
                ax.plot(*zip(*floor), style, marker="_", markersize=14, color="black", linewidth=2.5, alpha=0.5,
                        label=f"floor (roofline){'' if batch == 1 else f', batch {batch}'}")
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens" if phase == "prefill" else "context tokens",
               ylabel="tok/s", title=f"{phase}: " + ("prompt tokens / TTFT" if phase == "prefill" else "batch / TPOT"))
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(machine_line(result), 150), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
