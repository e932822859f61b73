"""Disaggregated prefill and decode, for real: two worker processes, the K/V sent between them.

Lesson 10 explains the split and notebook 09 does the hand-off inside one process; here each phase
has its own process and its own core, and the K/V crosses a torch.distributed link (gloo over
127.0.0.1 on the CPU; the same calls run on NCCL between GPUs)::

    DisaggregatedEngine (this process: the coordinator, no model runs here)
      add_request ──> prefill worker (rank 0) ══ K/V + first token ══> decode worker (rank 1)
      poll        <── first token (prefill worker), the other tokens (decode worker), with times

A request's greedy tokens are the colocated engine's: the K/V that crosses is the bytes the prefill
computed, and decoding needs only the weights, that K/V and the last token (lesson 10).

Failure: a worker that dies (killed, crashed, out of memory) or falls silent for ``timeout_s``
ends every unfinished request with finish_reason "error" and a message naming the worker, and
:meth:`DisaggregatedEngine.poll` raises :class:`WorkerDiedError` (one line); it never hangs.

The worker processes are started with the "spawn" method (a fresh interpreter: safe with torch's
threads, unlike fork), each loads the model from its folder, and both join a gloo group on a free
port of 127.0.0.1. This start-up is separate from the tensor-parallel launcher (:mod:`.launch`):
two fixed roles rather than N identical ranks.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import signal
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

from ..costs import kv_transfer_seconds
from ..errors import MiniLLMError
from ..generate import check_params, check_prompt
from ..sampling import SamplingParams
from ..serving.request import FINISHED, RUNNING, Request
from .disaggregated_workers import WORKER_NAMES, DisaggregatedConfig, WorkerModel, run_worker

__all__ = ["DisaggregatedConfig", "DisaggregatedEngine", "TransferSummary", "WorkerDiedError"]


class WorkerDiedError(MiniLLMError):
    """A worker of disaggregated serving died, failed or stopped answering: its requests cannot finish."""


@dataclass(frozen=True)
class TransferSummary:
    """The K/V hand-offs of a run, measured, next to lesson 10's formula at the measured link speed.

    Attributes:
        num_hand_offs: requests whose K/V crossed (those finished by their first token never do).
        prompt_tokens: their prompt positions, summed.
        num_bytes: K and V bytes sent (prompt_tokens · kv_bytes_per_token).
        kv_bytes_per_token: 2 · n_layers · n_kv_heads · head_dim · dtype bytes.
        transfer_s: the time the K/V took on the link, summed (s; per hand-off from the later of
            the send started and the receive posted, to the last byte received).
        link_bytes_s: the link's one-way bandwidth, measured once at start-up (bytes/s).
        predicted_s_per_token: lesson 10's floor for one token's K/V over that link,
            :func:`~minillm.costs.kv_transfer_seconds` (given the link in Gb/s, as links are quoted).
        hand_off_ms: per request, first token sampled -> K/V in the decode worker's pool (ms): the
            transfer plus the wait for the decode step under way.
    """

    num_hand_offs: int
    prompt_tokens: int
    num_bytes: int
    kv_bytes_per_token: int
    transfer_s: float
    link_bytes_s: float
    predicted_s_per_token: float
    hand_off_ms: list[float]

    @property
    def measured_s_per_token(self) -> float:
        """transfer_s / prompt_tokens: the measured time per prompt token (s)."""
        return self.transfer_s / self.prompt_tokens if self.prompt_tokens else math.nan

    @property
    def measured_bytes_s(self) -> float:
        """num_bytes / transfer_s: the bandwidth the hand-offs got (bytes/s)."""
        return self.num_bytes / self.transfer_s if self.transfer_s else math.nan

    def to_dict(self) -> dict:
        return {"num_hand_offs": self.num_hand_offs, "prompt_tokens": self.prompt_tokens, "num_bytes": self.num_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token, "transfer_s": self.transfer_s,
                "link_bytes_s": self.link_bytes_s, "predicted_s_per_token": self.predicted_s_per_token,
                "measured_s_per_token": self.measured_s_per_token,
                "measured_bytes_s": self.measured_bytes_s,
                "p50_hand_off_ms": statistics.median(self.hand_off_ms) if self.hand_off_ms else None}


class DisaggregatedEngine:
    """A prefill worker and a decode worker, each its own process on its own core, and this
    process coordinating them.

    Args:
        model: a model from :func:`~minillm.loading.load_model` on the CPU; each worker loads the
            same one from ``model.source`` (see :class:`WorkerModel`). This process runs no model.
        config: :class:`DisaggregatedConfig`.
        cores: the cores of the prefill and the decode worker; default the first two this
            process may use (both on one core when it has one; not pinned where the OS has no
            ``sched_setaffinity``, e.g. macOS).

    Attributes:
        requests: id -> :class:`~minillm.serving.request.Request`, updated by :meth:`poll` (output ids,
            token times, finish reason) as the engine's are, so run metrics read them the same way.
        hand_offs: one (request id, prompt tokens, bytes, transfer s, hand-off s) per K/V sent.
        link_bytes_s: the link's one-way bandwidth measured at start-up (bytes/s).
        pids: the workers' process ids, prefill first.

    Use it as a context manager (``with DisaggregatedEngine(model) as engine:``): the workers start
    on entry (raises WorkerDiedError when one cannot start within ``start_timeout_s``) and are shut
    down on exit.
    """

    def __init__(self, model, config: DisaggregatedConfig = DisaggregatedConfig(),
                 cores: Sequence[int] | None = None):
        self.model, self.config, self.spec = model, config, WorkerModel.of(model)
        if cores is None and hasattr(os, "sched_getaffinity"):
            allowed = sorted(os.sched_getaffinity(0))
            cores = [allowed[0], allowed[1 % len(allowed)]]
        self.cores = list(cores) if cores is not None else [None, None]  # None: not pinned (no affinity API)
        self.requests: dict[str, Request] = {}
        self.hand_offs: list[tuple[str, int, int, float, float]] = []
        self.link_bytes_s: float | None = None
        self.pids: list[int] = []
        self._processes: list = []
        self._last_event_s = time.perf_counter()

    # -- start and stop ---------------------------------------------------------------

    def __enter__(self) -> "DisaggregatedEngine":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start both workers and wait until each has loaded the model and warmed up.

        Raises WorkerDiedError when one dies or is not ready within ``start_timeout_s``."""
        context = multiprocessing.get_context("spawn")
        self._inbox, self._control, self._events = context.Queue(), context.Queue(), context.Queue()
        port = _free_port()
        for rank, core in enumerate(self.cores):
            process = context.Process(target=run_worker, name=f"minillm-{WORKER_NAMES[rank]}", daemon=True,
                                      args=(rank, self.spec, self.config, port, core,
                                            self._inbox if rank == 0 else None, self._control, self._events))
            process.start()
            self._processes.append(process)
        self.pids = [p.pid for p in self._processes]
        ready, deadline = {}, time.perf_counter() + self.config.start_timeout_s
        while len(ready) < 2:
            self._check_alive()
            if time.perf_counter() > deadline:
                self._fail(f"the workers were not ready within {self.config.start_timeout_s:g} s (loading the model, "
                           "joining the gloo group); raise start_timeout_s on a busy machine")
            try:
                event = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            if event[0] == "error":
                self._worker_failed(event[1], event[2])
            ready[event[1]] = event[2]
        self.link_bytes_s = ready[0]["link_bytes_s"]
        self._last_event_s = time.perf_counter()

    def close(self, graceful: bool = True) -> None:
        """Shut the workers down: gracefully when both are alive and idle (the prefill worker tells
        the decode worker), else (or after 10 s) terminated. Safe to call twice."""
        if not self._processes:
            return
        graceful = graceful and all(p.is_alive() for p in self._processes) and not self.has_unfinished_requests()
        if graceful:
            self._inbox.put(None)
        deadline = time.perf_counter() + (10.0 if graceful else 0.0)
        for process in self._processes:
            process.join(max(deadline - time.perf_counter(), 0.0))
        for process in self._processes:
            if process.is_alive():
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()
        for q in (self._inbox, self._control, self._events):
            q.cancel_join_thread()  # a worker gone mid-message must not hold this process at exit
            q.close()
        self._processes = []

    # -- requests in, tokens out ------------------------------------------------------

    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_s: float | None = None) -> str:
        """Queue a prompt (token ids) on the prefill worker; returns its request id.

        Raises ValueError for an empty prompt or ids outside the vocabulary, a prompt beyond the
        context, one longer than max_num_batched_tokens without chunked prefill, a duplicate id, or
        constrained decoding (``allowed_tokens``: its matcher does not cross processes).
        """
        prompt = check_prompt(prompt_ids).tolist()
        params = check_params(self.model, params, None)
        vocab, context, budget = self.model.config.vocab_size, self.model.config.max_seq_len, \
            self.config.max_num_batched_tokens
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt ids must be in [0, {vocab}) (the vocabulary), got {min(prompt)}..{max(prompt)}")
        if len(prompt) > context:
            raise ValueError(f"the prompt is {len(prompt)} tokens but the model's context is {context}; shorten it")
        if len(prompt) > budget and not self.config.enable_chunked_prefill:
            raise ValueError(f"the prompt is {len(prompt)} tokens, more than max_num_batched_tokens ({budget}), "
                             "and chunked prefill is off; raise max_num_batched_tokens or enable chunked prefill")
        if params.allowed_tokens is not None:
            raise ValueError("disaggregated serving does not support constrained decoding (allowed_tokens); "
                             "use LLMEngine")
        request_id = str(len(self.requests) if request_id is None else request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use; give a new one or leave it out")
        arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        self.requests[request_id] = Request(request_id, prompt, params, arrival_s)
        self._inbox.put((request_id, prompt, params, arrival_s))
        self._last_event_s = max(self._last_event_s, time.perf_counter())
        return request_id

    def has_unfinished_requests(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    def poll(self, timeout_s: float = 0.1) -> list[str]:
        """Apply what the workers reported (waiting up to ``timeout_s`` for the first report);
        returns the ids of the requests that changed.

        Raises WorkerDiedError when a worker died, failed, or said nothing for ``config.timeout_s``
        while requests are unfinished; those requests end with finish_reason "error" first.
        """
        changed: list[str] = []
        try:
            event = self._events.get(timeout=timeout_s)
        except queue.Empty:
            event = None
        while event is not None:
            self._last_event_s = time.perf_counter()
            changed += self._apply(event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                event = None
        self._check_alive()
        silent_s = time.perf_counter() - self._last_event_s
        if self.has_unfinished_requests() and silent_s > self.config.timeout_s:
            self._fail(f"no answer from the workers for {silent_s:.0f} s (timeout_s {self.config.timeout_s:g}) with "
                       "requests unfinished")
        return list(dict.fromkeys(changed))

    def generate(self, prompts: Sequence, params: SamplingParams | None = None) -> list[Request]:
        """Run prompts (token id lists) to completion; the finished requests in prompt order.

        Raises ValueError as :meth:`add_request`, WorkerDiedError as :meth:`poll`."""
        ids = [self.add_request(p, params) for p in prompts]
        while any(not self.requests[i].finished for i in ids):
            self.poll(0.5)
        return [self.requests[i] for i in ids]

    def transfer_summary(self) -> TransferSummary:
        """The hand-offs so far, summed (see :class:`TransferSummary`)."""
        config, dtype_bytes = self.model.config, next(self.model.parameters()).element_size()
        link = self.link_bytes_s or math.nan
        predicted = kv_transfer_seconds(config, 1, dtype_bytes, link * 8 / 1e9) if link > 0 else math.nan
        return TransferSummary(len(self.hand_offs), sum(h[1] for h in self.hand_offs),
                               sum(h[2] for h in self.hand_offs), config.kv_bytes_per_token(dtype_bytes),
                               sum(h[3] for h in self.hand_offs), link, predicted,
                               [h[4] * 1e3 for h in self.hand_offs])

    # -- events -----------------------------------------------------------------------

    def _apply(self, event) -> list[str]:
        kind = event[0]
        if kind == "error":
            self._worker_failed(event[1], event[2])
        if kind == "transfers":
            self.hand_offs += event[1]
            return []
        changed = []
        if kind == "first":
            for request_id, token, time_s, first_scheduled_s, reason, message in event[1]:
                request = self.requests[request_id]
                request.status, request.first_scheduled_s = RUNNING, first_scheduled_s
                self._update(request, token, time_s, reason, message)
                changed.append(request_id)
        elif kind == "tokens":
            for request_id, token, time_s, reason, message in event[1]:
                self._update(self.requests[request_id], token, time_s, reason, message)
                changed.append(request_id)
        return changed

    @staticmethod
    def _update(request: Request, token: int | None, time_s: float, reason: str | None, message: str | None) -> None:
        if token is not None:
            request.output_ids.append(token)
            request.token_times_s.append(time_s)
        if reason is not None:
            request.status, request.finish_reason, request.message = FINISHED, reason, message
            request.finish_s = time.perf_counter()

    def _check_alive(self) -> None:
        for rank, process in enumerate(self._processes):
            if not process.is_alive():
                self._fail(f"the {WORKER_NAMES[rank]} worker (rank {rank}, pid {process.pid}) died "
                           f"({_exit_text(process.exitcode)})")

    def _worker_failed(self, rank: int, text: str) -> None:
        """A worker reported a failure: blame the other one if it died (its death caused this one)."""
        other = self._processes[1 - rank]
        other.join(1.0)
        if not other.is_alive():
            self._check_alive()
        self._fail(f"the {WORKER_NAMES[rank]} worker (rank {rank}) failed: {text}")

    def _fail(self, reason: str):
        """End every unfinished request with "error", stop the workers, raise WorkerDiedError."""
        unfinished = [r for r in self.requests.values() if not r.finished]
        for request in unfinished:
            self._update(request, None, 0.0, "error", reason)
        self.close(graceful=False)
        raise WorkerDiedError(f"disaggregated serving stopped: {reason}; {len(unfinished)} unfinished request(s) "
                              "ended with finish_reason 'error'")


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
