"""AsyncEngine: the batching engine in one background thread, fed by many asyncio clients.

An HTTP server handles each request in a coroutine, but :class:`LLMEngine` is synchronous and
must run one step at a time. So the engine gets its own thread, and the two sides meet in
queues (vLLM's ``AsyncLLMEngine`` / ``AsyncLLM``, in small)::

    coroutines (one per HTTP request)           engine thread (one), in a loop
    ─────────────────────────────────           ──────────────────────────────────────────
    generate(): AddRequest(...) ──commands──┐   with lock:
    client gone: AbortRequest(id) ──────────┤       apply the commands, in order
    a watchdog: LoseEngine(reason) ─────────┴──>    outputs = engine.step()
                await its queue  <────────────────  each output -> its request's queue
                yield RequestOutput

Commands are small frozen dataclasses, one per kind (:data:`Command`); the thread dispatches on
their type. They wait in a queue rather than each taking the lock: requests that arrive during a
step all join the next one (a lock taken per request could let only one in per step).
``lock`` is held around every ``engine.step()`` and every change to the engine; whoever reads
engine state (a web view, /metrics) takes it too, so they never see a step half done.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from ...errors import EngineLostError, MiniLLMError
from ...sampling import SamplingParams
from ..engine import LLMEngine, RequestOutput
from ..kv_tiers import CachePoint
from ..request import Request, sequence_id

logger = logging.getLogger(__name__)


class QueueFullError(MiniLLMError):
    """The engine's waiting queue is at its limit; the client should retry later (HTTP 503)."""


class EngineDeadError(MiniLLMError):
    """A step of the engine raised, or the server is stopping: the request was aborted (HTTP 500)."""


class RequestFailedError(MiniLLMError):
    """A part of this request failed during a step (its constraint, its logits row, its stop strings):
    it alone was ended (the engine's ``finish_reason == "error"``; other requests go on).

    Attributes: part (the engine's ``stop_reason``: "allowed_tokens", "logits", "sampling", "stop",
    "prompt_logprobs")."""

    def __init__(self, message: str, part: str | None):
        super().__init__(message)
        self.part = part


class ShuttingDownError(EngineDeadError):
    """The server is shutting down: a new request is refused, an unfinished one ended (HTTP 503)."""


class EngineGoneError(EngineDeadError):
    """The engine is lost for good (``AsyncEngine.lost``: a tensor-parallel rank died): a new request is
    refused (HTTP 503, code "engine_dead"), until the server exits or is restarted."""


@dataclass(frozen=True)
class AddRequest:
    """Add a request to the engine (``LLMEngine.add_request``'s arguments), or refuse it; either way
    resolve ``added``, a future of the client's event loop (an exception: refused, and why)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    logprobs: int | None
    prompt_logprobs: int | None
    n: int
    arrival_s: float  # time.perf_counter() when the client sent it: TTFT and queue time count from here
    added: asyncio.Future
    cache_salt: str | None = None
    cache_point: CachePoint | Sequence[CachePoint] | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request (all n of its sequences); an unknown or finished id changes nothing."""

    request_id: str


@dataclass(frozen=True)
class LoseEngine:
    """The engine can run no more steps (a tensor-parallel rank died): fail the requests in flight
    with ``reason``, refuse new ones."""

    reason: str


Command = AddRequest | AbortRequest | LoseEngine  # what clients send the engine thread


class AsyncEngine:
    """Runs ``engine`` in a background thread; :meth:`generate` streams a request's outputs.

    Args:
        engine: the :class:`LLMEngine` to drive (no one else should step it), or a function that
            builds it (loads the model, makes the engine): called in the engine thread, and the
            constructor returns once it has, raising what it raised. ``minillm serve`` builds so,
            for the reason under :meth:`_run`.
        max_waiting_requests: refuse new requests (:class:`QueueFullError`) while this many are
            waiting for a first slot; None: no limit (vLLM answers 503 the same way when its
            queue is full).
        on_finished: called in the engine thread, under ``lock``, with each engine
            :class:`Request` that finishes (any reason, aborts included): the metrics hook.
        max_finished_requests: finished requests kept in ``engine.requests`` (for a web view);
            older ones are dropped, so a server's memory does not grow with every request it
            has answered.
        max_step_records: step records kept in ``engine.steps`` (the newest, 1 to 2 times this many;
            the web view shows the last): a record holds a tuple per request in its batch, 2.6 KB at
            32 (measured), so a server that kept them all grew ~140 MB an hour at 15 steps a second.
        before_step: called in the engine thread before each step, outside ``lock`` (``minillm serve``:
            the thread governor of minillm/cpu_policy.py, since torch's thread count is per thread).

    Attributes:
        engine, lock (a ``threading.Lock``: hold it to read engine state), max_waiting_requests.
        lost: why the engine can run no more steps (a step raised :class:`~minillm.errors.EngineLostError`),
            or None.
        on_lost: called once with ``lost`` as it is set, in the engine thread under ``lock``, so it must
            return at once (``minillm serve``: the server shuts down a little later); None: nothing.
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_waiting_requests: int | None = None,
                 on_finished: Callable[[Request], None] | None = None, max_finished_requests: int = 1000,
                 before_step: Callable[[], object] | None = None, max_step_records: int = 1000):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 (or None: no limit), got {max_waiting_requests}")
        if max_finished_requests < 0:
            raise ValueError(f"max_finished_requests must be >= 0, got {max_finished_requests}")
        if max_step_records < 1:
            raise ValueError(f"max_step_records must be >= 1, got {max_step_records}")
        build = None if isinstance(engine, LLMEngine) else engine
        self.engine = None if build else engine
        self.max_waiting_requests, self.on_finished = max_waiting_requests, on_finished
        self.max_finished_requests, self.max_step_records = max_finished_requests, max_step_records
        self.before_step = before_step  # called in the engine thread before each step (minillm serve: threads)
        self._finished_ids: collections.deque[str] = collections.deque()  # oldest finished first
        self.lock = threading.Lock()
        self._wake = threading.Event()  # set when there is work: a command, or requests to step
        self._stopping = False
        self.lost: str | None = None  # why the engine can run no more steps (EngineLostError): /health says 503
        self.on_lost: Callable[[str], object] | None = None  # told once, when ``lost`` is set
        self.step_failure: str | None = None  # why the last step failed, until one succeeds: /health says 503
        self._draining = False  # set by drain(): new requests are refused, running ones go on
        self._commands: collections.deque[Command] = collections.deque()  # appended by clients, popped by the thread
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._build_error: BaseException | None = None
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="minillm-engine", daemon=True)
        self._thread.start()
        if build is not None:
            try:
                built.wait()
            except KeyboardInterrupt:  # Ctrl-C while it loads: the program must not end while the thread is in
                self._stopping = True  # torch (it aborts), so wait for the build, then let the thread end
                self._wake.set()
                self._thread.join()  # (a second Ctrl-C leaves at once)
                raise
            if self._build_error is not None:
                raise self._build_error

    def __repr__(self) -> str:
        return f"AsyncEngine({self.engine!r}, streams={len(self._queues)}, running={self._thread.is_alive()})"

    def wake(self) -> None:
        """Tell the thread there is work: call it after adding to the engine directly (under ``lock``)."""
        self._wake.set()

    def is_alive(self) -> bool:
        """True while the engine thread runs and can step (False after :meth:`close`, or once a step raised
        :class:`~minillm.errors.EngineLostError`: a tensor-parallel rank died; ``lost`` says why)."""
        return self._thread.is_alive() and self.lost is None

    # -- the client side (coroutines in the server's event loop) ---------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       logprobs: int | None = None, prompt_logprobs: int | None = None, n: int = 1,
                       cache_salt: str | None = None, cache_point: CachePoint | Sequence[CachePoint] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Queue a prompt and yield its :class:`RequestOutput` each step it changes, the last finished.

        ``request_id``: default a fresh random one; ``logprobs``, ``prompt_logprobs``, ``cache_salt``,
        ``cache_point``: as ``LLMEngine.add_request``. ``n`` > 1: the outputs of its n sequences,
        interleaved, each with its ``index``; the loop ends when all n have finished.
        Leaving the loop early (a client that disconnects cancels the coroutine, or ``aclose()``)
        aborts the request: its blocks go back to the pool before the engine's next step.
        The request's arrival is stamped here, not when the engine thread adds it, so TTFT,
        e2e and queue time include its wait in the command queue (vLLM stamps arrival as it
        takes a request in, before its engine core sees it).

        Raises ValueError as ``LLMEngine.add_request`` (a bad prompt), QueueFullError when
        the waiting queue is at ``max_waiting_requests``, RequestFailedError when a part of this
        request failed during a step (after the outputs before it), EngineDeadError when a whole
        step failed.
        """
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        if request_id in self._queues:  # checked here: the engine's own check comes after its queue is set
            raise ValueError(f"request id {request_id!r} is already streaming; give a new one or leave it out")
        added = loop.create_future()  # the engine thread resolves it when it has added the request
        self._queues[request_id] = (loop, queue)
        self._send(AddRequest(request_id, prompt_ids, params, logprobs, prompt_logprobs, n, time.perf_counter(), added,
                              cache_salt, cache_point))
        try:
            await added
        except asyncio.CancelledError:  # the client left while the add was queued: the abort follows it
            self.abort(request_id)
            raise
        except Exception:  # refused (a bad prompt, a full queue): nothing to abort
            self._queues.pop(request_id, None)
            raise
        finished, unfinished = False, n
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.finish_reason == "error":  # n > 1: the finally aborts its other sequences
                    raise RequestFailedError(out.message, out.stop_reason)
                unfinished -= out.finished
                finished = unfinished == 0
                yield out
        finally:
            if finished:
                self._queues.pop(request_id, None)
            else:  # cancelled or closed early
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request before the engine's next step (its blocks are freed then); its client
        hears nothing more. Unknown or finished ids change nothing."""
        self._queues.pop(request_id, None)
        self._send(AbortRequest(request_id))

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Refuse new requests (ShuttingDownError) and wait up to ``timeout_s`` seconds for the
        streaming ones to finish; then end each that is left with ShuttingDownError (a stream
        gets its error event and ``[DONE]``). Returns how many were ended unfinished.

        A graceful shutdown (SIGTERM, Ctrl-C), as vLLM's server does it; the engine thread keeps
        running, :meth:`close` stops it.
        """
        self._draining = True
        if self._queues:
            logger.warning("shutting down: refusing new requests, waiting up to %g s for %d running", timeout_s,
                           len(self._queues))
        deadline = time.monotonic() + timeout_s
        while self._queues and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        stopped = ShuttingDownError(f"the server shut down before the request finished (it waited {timeout_s:g} s "
                                    "for running requests); send it again when the server is back")
        with self.lock:
            left = list(self._queues)
            for request_id in left:
                self._abort_now(request_id)
                self._deliver(request_id, stopped)
        return len(left)

    def _send(self, command: Command) -> None:
        self._commands.append(command)
        self.wake()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (after the step it is in); unfinished requests are aborted; then
        ``engine.close()`` writes the KV blocks that must outlive the process to the disk tier
        (``--kv-offload-dir``: a restarted server finds them there). Idempotent."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        with self.lock:
            self._apply_commands()  # refuses the adds still queued
            stopped = EngineDeadError("the server shut down before the request finished")
            for request_id in list(self._queues):
                self._abort_now(request_id)
                self._deliver(request_id, stopped)
            self.engine.close()

    # -- the engine thread ---------------------------------------------------------------

    def _run(self, build: Callable[[], LLMEngine] | None, built: threading.Event) -> None:
        """The engine thread: ``build`` the engine first when given one (the constructor waits for
        ``built``), then step it until stopped.

        Why the build runs here: on a CPU, torch's threads are an OpenMP team of the thread that starts
        parallel work, one team per such thread, and GNU OpenMP keeps a team's threads spinning between
        parallel regions only while it manages no more threads than there are cores. A model loaded by
        the main thread leaves it a team; the engine thread then makes a second, and every region's
        threads go to sleep and must be woken: the issue 32 workload's steps took 24.2 s in all, against
        19.6 s with the loading and the steps on one thread (2 cores, 2026-12-02)."""
        if build is not None:
            try:
                self.engine = build()
            except BaseException as error:  # raised again by the constructor, in its own thread
                self._build_error = error
                return
            finally:
                built.set()
        while not self._stopping:
            self._wake.wait()
            if self.before_step is not None:
                self.before_step()
            with self.lock:
                try:
                    self._step()
                except Exception as error:  # no request owns it (a bug, a device error): fail those in flight
                    self.step_failure = f"{type(error).__name__}: {error}"
                    self._fail_all(error)
                    if isinstance(error, EngineLostError):
                        self._lose(str(error))
            # threading.Lock is not fair: released and taken again at once, it can starve a reader
            # (the web view, /metrics) for several steps. Yielding the GIL lets a waiter in first
            # (measured: /engine/state round trip 252 -> 183 ms median during 3 decodes).
            time.sleep(0)

    def _step(self) -> None:
        """Under the lock: apply the commands, run one engine step, hand each output to its client."""
        self._apply_commands()
        if not self.engine.has_unfinished_requests():
            self._wake.clear()  # sleep until a command sets it again
            if self._commands:  # one came in between: do not sleep on it
                self._wake.set()
            return
        outputs = self.engine.step()
        self.step_failure = None
        if len(self.engine.steps) > 2 * self.max_step_records:  # (in halves: a list's front costs a copy to drop)
            del self.engine.steps[: -self.max_step_records]
        for out in outputs:
            if out.finished:
                self._finished(self.engine.requests[sequence_id(out.request_id, out.index)])
            self._deliver(out.request_id, out)

    def _apply_commands(self) -> None:
        """Under the lock: apply the queued commands, oldest first."""
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, AddRequest):
                self._add_now(command)
            elif isinstance(command, AbortRequest):
                self._abort_now(command.request_id)
            elif isinstance(command, LoseEngine):
                self._fail_all(EngineLostError(command.reason))
                self._lose(command.reason)
            else:
                raise TypeError(f"not a command of the engine thread: {command!r}")

    def lose(self, reason: str) -> None:
        """The engine can run no more steps (a watchdog saw a tensor-parallel rank die while no step ran):
        before the next step, the requests in flight fail with ``reason`` and new ones are refused, as when
        a step finds it (:class:`EngineGoneError`, HTTP 503)."""
        self._send(LoseEngine(reason))

    def _lose(self, reason: str) -> None:
        """Under the lock: from now on refuse (``lost``), and tell ``on_lost`` once."""
        if self.lost is None:
            self.lost = reason
            if self.on_lost is not None:
                self.on_lost(reason)

    def _add_now(self, add: AddRequest) -> None:
        """Add a request, or refuse it (full queue, bad prompt, stopping); tell its client which."""
        error = None
        waiting = len(self.engine.scheduler.waiting)
        if self.lost is not None:
            error = EngineGoneError(f"the engine cannot run: {self.lost}; restart the server")
        elif self._stopping or self._draining:
            error = ShuttingDownError("the server is shutting down; send the request again when it is back")
        elif self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            try:  # an n that no wait would make right is the client's to fix (400), not to retry (503)
                self.engine.check_n(add.n)
            except ValueError as bad:
                error = bad
            else:
                error = QueueFullError(f"the waiting queue is full ({waiting} requests, limit "
                                       f"{self.max_waiting_requests}: --max-waiting-requests); retry later")
        else:
            try:
                self.engine.add_request(add.prompt_ids, add.params, add.request_id, arrival_s=add.arrival_s,
                                        logprobs=add.logprobs, prompt_logprobs=add.prompt_logprobs, n=add.n,
                                        cache_salt=add.cache_salt, cache_point=add.cache_point)
            except ValueError as bad:
                error = bad
        try:
            add.added.get_loop().call_soon_threadsafe(_resolve, add.added, error)
        except RuntimeError:  # the client's event loop is closed (server shutting down)
            pass

    def _abort_now(self, request_id: str) -> None:
        request = self.engine.requests.get(request_id)
        if request is not None:
            unfinished = [r for r in self.engine.sequences(request_id) if not r.finished]  # n > 1: all n
            self.engine.abort_request(request_id)
            for sequence in unfinished:
                self._finished(sequence)

    def _finished(self, request: Request) -> None:
        """A request ended: the metrics hook, then forget the oldest finished beyond the limit."""
        self._finished_ids.append(request.request_id)
        while len(self._finished_ids) > self.max_finished_requests:
            self.engine.requests.pop(self._finished_ids.popleft(), None)
        if self.on_finished is not None:
            self.on_finished(request)

    def _deliver(self, request_id: str, item) -> None:
        target = self._queues.get(request_id)
        if target is None:  # its client left: nobody to tell
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the client's event loop is closed (server shutting down)
            self._queues.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        """A step raised, and no request owns the failure (those the engine ends alone): abort every
        unfinished request and tell each client, one line. (No metrics hook here: it may be what raised.)"""
        gone = isinstance(error, EngineLostError)  # a rank died: these requests hear what later ones will (503)
        message = (EngineGoneError if gone else EngineDeadError)(
            f"the engine failed during a step: {type(error).__name__}: {error}")
        unfinished = {request_id for request_id, request in self.engine.requests.items() if not request.finished}
        for request_id in list(self.engine.requests):
            if request_id in unfinished:  # (aborting a request with n > 1 ends its other sequences too)
                self.engine.abort_request(request_id)
                self._finished_ids.append(request_id)  # forgotten in turn, like the others
            self._deliver(request_id, message)


def _resolve(added: asyncio.Future, error: Exception | None) -> None:
    """In the client's event loop: the add happened (or was refused with ``error``)."""
    if added.cancelled():  # the client left meanwhile; its abort command follows
        return
    if error is None:
        added.set_result(None)
    else:
        added.set_exception(error)
