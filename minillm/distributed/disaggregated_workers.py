"""The two worker processes of disaggregated serving: one prefills, the other decodes.

    coordinator ──(prompt, arrival)──> prefill worker (rank 0, core 0)
                                          Scheduler + PagedKVCache: prefill, sample the first token,
                                          gather the prompt's K/V, isend it, free the blocks
                                               ║ torch.distributed (gloo, 127.0.0.1)
                                               ▼
                                       decode worker (rank 1, core 1)
                                          receive between steps, write the K/V into its own pool,
                                          continue the request in an LLMEngine's continuous batch
    coordinator <──(tokens, times)──── both workers

Each worker is one process pinned to one core with one torch thread, so the two phases never
time-share a core (lesson 10: the point of splitting them). The prefill worker uses the
engine's own pieces (:class:`Scheduler`, :class:`PagedKVCache`, :func:`run_model`,
:func:`sample_rows`) without a decode phase; the decode worker is an :class:`LLMEngine` whose
requests arrive already prefilled (status running, ``num_computed_tokens`` = the prompt).
Requests and tokens travel to and from the coordinator on multiprocessing queues (small
messages); only the K/V crosses the torch.distributed link (:mod:`.disaggregated_transfer`).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..generate import eos_token_set
from ..loading import load_model
from ..sampling import SamplingParams
from ..serving.engine import LLMEngine
from ..serving.model_runner import run_model, sample_rows
from ..serving.paged_cache import PagedKVCache
from ..serving.request import RUNNING, Request
from ..serving.scheduler import Scheduler
from ..stopping import check_stop
from .disaggregated_transfer import (PREFILL_RANK, HandOffSender, Received, gather_prompt_kv, hand_off_of,
                                     measure_link_bytes_s, receive_kv, scatter_prompt_kv)

WORKER_NAMES = {PREFILL_RANK: "prefill", 1 - PREFILL_RANK: "decode"}


@dataclass(frozen=True)
class DisaggregatedConfig:
    """The knobs of both workers (vLLM's names) and the time limits that keep a failure from hanging.

    Attributes:
        max_num_seqs: most requests in one batch, on each worker.
        max_num_batched_tokens: the prefill worker's token budget per step (the decode worker
            uses it too, for recomputing a preempted request).
        enable_chunked_prefill: the prefill worker cuts prompts into budget-sized chunks.
        kv_cache_memory: each worker's own paged pool ("512MiB", bytes): twice this in all.
        block_size: positions per KV block, on both.
        eos_token_ids: ids that end a request; None: the checkpoint's (() ignores EOS, as benchmarks do).
        timeout_s: torch.distributed's timeout (a receive waits at most this long), and the
            coordinator's limit on a silence while requests are unfinished (s).
        start_timeout_s: the limit on starting both workers and loading the model (s).
        link_probe_bytes: bytes of the one-off bandwidth probe between the workers.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    kv_cache_memory: str | int = "512MiB"
    block_size: int = 16
    eos_token_ids: tuple[int, ...] | None = None
    timeout_s: float = 60.0
    start_timeout_s: float = 180.0
    link_probe_bytes: int = 64 * 2**20


@dataclass(frozen=True)
class WorkerModel:
    """How a worker loads the same model as the coordinator's (the same folder, dtype, quantisation
    and speed layer): weights identical in every process, read from disk rather than pickled."""

    path: str
    dtype: str
    quantize: str | None
    fast: bool
    attn_impl: str

    @classmethod
    def of(cls, model) -> "WorkerModel":
        """The spec of a model from :func:`~minillm.loading.load_model` on the CPU.

        Raises ValueError for a model that has no folder (built in memory) or is not on the CPU."""
        param = next(model.parameters())
        if getattr(model, "source", None) is None:
            raise ValueError("disaggregated serving loads the model in each worker from its folder, and this model "
                             "has none; load it with minillm.load_model(folder)")
        if param.device.type != "cpu":
            raise ValueError(f"disaggregated serving runs on the CPU (gloo), the model is on {param.device}; "
                             "load it with device='cpu'")
        return cls(str(model.source), str(param.dtype).removeprefix("torch."), getattr(model, "quantization", None),
                   model.decode_path is not None, model.attn_impl)

    def load(self):
        return load_model(self.path, device="cpu", dtype=self.dtype, attn_impl=self.attn_impl,
                          quantize=self.quantize, fast=self.fast)


def run_worker(rank: int, spec: WorkerModel, config: DisaggregatedConfig, port: int, core: int | None,
               inbox, control, events) -> None:
    """A worker process's whole life: pin, join the group, load, probe the link, warm up, serve.

    Queues: ``inbox`` (coordinator -> prefill worker: requests, None to shut down), ``control``
    (prefill -> decode worker: :class:`HandOff` notices, None when no more come), ``events``
    (both -> coordinator).

    Reports ("ready", rank, info) once serving, and ("error", rank, one line) before exiting on
    any failure (the coordinator then ends the unfinished requests).
    """
    joined = False
    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=config.timeout_s))
        joined = True
        model = spec.load()
        link_bytes_s = measure_link_bytes_s(rank, config.link_probe_bytes)
        _warm_up(model)
        events.put(("ready", rank, {"pid": os.getpid(), "core": core, "link_bytes_s": link_bytes_s}))
        if rank == PREFILL_RANK:
            _prefill_loop(model, config, inbox, control, events)
        else:
            _decode_loop(model, config, control, events)
    except Exception as e:  # any failure: one line to the coordinator, then exit
        text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        events.put(("error", rank, f"{type(e).__name__}: {text}"))
        raise SystemExit(1) from None
    finally:
        if joined:
            dist.destroy_process_group()


def _warm_up(model) -> None:
    """A few untimed steps: PyTorch's first calls are slow."""
    LLMEngine(model, kv_cache_memory="8MiB", max_num_batched_tokens=64, eos_token_ids=[]).generate(
        [[1] * 8, [1] * 3], SamplingParams(max_new_tokens=2))


def _parent_alive() -> bool:
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


# -- the prefill worker ---------------------------------------------------------------------


def _prefill_loop(model, config: DisaggregatedConfig, inbox, control, events) -> None:
    """Prefill every arriving prompt, report its first token, hand its K/V to the decode worker.

    A request that ends with its first token (EOS, or max_new_tokens 1) is finished here and
    never crosses. Returns after the coordinator's None (the shut-down), once every send is done.
    """
    cache = PagedKVCache.for_model(model, config.kv_cache_memory, config.block_size, enable_prefix_caching=False)
    scheduler = Scheduler(cache.allocator, config.max_num_seqs, config.max_num_batched_tokens,
                          config.enable_chunked_prefill)
    eos = eos_token_set(model, None if config.eos_token_ids is None else list(config.eos_token_ids))
    context, sender = model.config.max_seq_len, HandOffSender(control)
    while True:
        for message in _arrivals(inbox, wait=not scheduler.has_unfinished()):
            if message is None:
                sender.close()
                return
            request_id, prompt_ids, params, arrival_s = message
            scheduler.add(Request(request_id, prompt_ids, params, arrival_s, generator=params.make_generator("cpu")))
        if sender.error is not None:
            raise RuntimeError(f"sending K/V to the decode worker failed: {sender.error}")
        if not scheduler.has_unfinished():
            continue
        batch = scheduler.schedule()
        firsts = [(r.request_id, None, None, r.first_scheduled_s, r.finish_reason, r.message) for r in batch.finished]
        if batch:
            sampling, logits = run_model(model, cache, batch)
            tokens, _, failures = sample_rows(logits, sampling)
            now = time.perf_counter()
            for request, n in zip(batch.requests, batch.num_tokens):
                request.num_computed_tokens += n
            for row, (part, why) in failures.items():  # that request alone ends (the engine's rule)
                request, message = sampling[row], f"the request's {part} failed before its first token: {why}"
                firsts.append((request.request_id, None, None, request.first_scheduled_s, "error", message))
                scheduler.finish(request, "error", part, message)
            for request, token in zip(sampling, tokens):
                if token is None:
                    continue
                request.output_ids.append(token)
                request.token_times_s.append(now)
                reason, _, _ = check_stop(token, 1, eos, request.params, request.num_tokens > context, None)
                reason = "length" if reason == "cache_full" else reason
                if reason is None:  # the request goes on: its prompt's K/V to the decode worker
                    table = cache.allocator.block_tables[request.request_id]
                    k, v = gather_prompt_kv(cache, table, request.num_prompt_tokens)
                    sender.submit(hand_off_of(request), k, v)
                firsts.append((request.request_id, token, now, request.first_scheduled_s, reason, None))
                scheduler.finish(request, reason or "handed off")  # its blocks are free for the next prompt
        if firsts:
            events.put(("first", firsts))


def _arrivals(inbox, wait: bool) -> list:
    """Every message in the inbox now; with ``wait``, block until one comes (checking the parent
    each second: a worker outlives no coordinator)."""
    messages = []
    while wait and not messages:
        try:
            messages.append(inbox.get(timeout=1.0))
        except queue.Empty:
            if not _parent_alive():
                raise RuntimeError("the coordinator process is gone") from None
    while True:
        try:
            messages.append(inbox.get_nowait())
        except queue.Empty:
            return messages


# -- the decode worker ----------------------------------------------------------------------


def _decode_loop(model, config: DisaggregatedConfig, control, events) -> None:
    """Receive hand-offs between steps, admit them into the engine's running batch, decode.

    Returns after the prefill worker's None (no more hand-offs), once every request has finished.
    """
    engine = LLMEngine(model, kv_cache_memory=config.kv_cache_memory, block_size=config.block_size,
                       max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                       enable_chunked_prefill=True,  # a preempted request's recompute must fit some step
                       enable_prefix_caching=False,
                       eos_token_ids=None if config.eos_token_ids is None else list(config.eos_token_ids))
    cfg, dtype = model.config, next(model.parameters()).dtype
    arrived: deque[Received] = deque()
    shut_down = False
    while True:
        idle = not (engine.has_unfinished_requests() or arrived)
        while not shut_down:
            try:  # idle: wait a little for the next notice rather than spin; busy: only what is there
                hand_off = control.get(timeout=0.05) if idle else control.get_nowait()
            except queue.Empty:
                break
            shut_down, idle = hand_off is None, False
            if hand_off is not None:
                arrived.append(receive_kv(hand_off, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype))
        admitted = []
        while arrived and _admit(engine, arrived[0]):
            got = arrived.popleft()
            admitted.append((got.hand_off.request_id, len(got.hand_off.prompt_ids), got.num_bytes, got.transfer_s,
                             time.perf_counter() - got.hand_off.first_token_s))
        if admitted:
            events.put(("transfers", admitted))
        if engine.has_unfinished_requests():
            outputs = engine.step()
            events.put(("tokens", [(o.request_id, o.new_token_ids[0] if o.new_token_ids else None,
                                    engine.requests[o.request_id].token_times_s[-1], o.finish_reason, o.message)
                                   for o in outputs]))
        elif shut_down and not arrived:
            return
        elif idle and not _parent_alive():
            raise RuntimeError("the coordinator process is gone")


def _admit(engine: LLMEngine, got: Received) -> bool:
    """Put a received request into the engine's running batch, its prompt's K/V in the engine's own
    blocks; False when the batch or the pool has no room yet (it waits for a request to finish)."""
    h, scheduler, allocator = got.hand_off, engine.scheduler, engine.cache.allocator
    num_positions = len(h.prompt_ids)
    if len(scheduler.running) >= scheduler.max_num_seqs or not allocator.allocate_slots(h.request_id, num_positions):
        return False
    scatter_prompt_kv(engine.cache, allocator.block_tables[h.request_id], got.k, got.v)
    generator = h.params.make_generator("cpu")
    if h.generator_state is not None:  # the draws continue where the prefill worker's first one left them
        generator.set_state(h.generator_state)
    request = Request(h.request_id, h.prompt_ids, h.params, h.arrival_s, output_ids=[h.first_token],
                      status=RUNNING, num_computed_tokens=num_positions, first_scheduled_s=h.first_scheduled_s,
                      token_times_s=[h.first_token_s], generator=generator)
    engine.requests[h.request_id] = request
    scheduler.running.append(request)
    return True
