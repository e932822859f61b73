"""The step trace: what every engine step did, kept so that a run can be replayed and drawn.

One :class:`StepRecord` per :meth:`LLMEngine.step`: the batch (which requests, how many
prefill and decode tokens each), the wall time of the step, the pool's blocks after it,
and who was preempted or finished. With the requests' own timestamps (arrival, first
scheduled, each token, finish) this is everything a timeline needs:

    StepRecord               one step: batch, time, blocks, preempted, finished
    request_spans            one request's life as queued / prefill / decode spans
    spans_by_request         the same for every request of a run
    chrome_trace_events      the run for Perfetto: a scheduler track, a track per request, counters
    write_chrome_trace       the same, validated and written as a .json file

The terminal tables are :mod:`minillm.views.serving_terminal`; the plots :mod:`minillm.views.serving_plots`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..formats.trace_events import complete, counter, instant, process_name, thread_name, thread_sort_index, write


@dataclass(frozen=True)
class StepRecord:
    """One engine step.

    Attributes:
        step: 0, 1, 2, ...
        start_s, end_s: ``time.perf_counter()`` around the step: scheduling, the forward
            pass, sampling and bookkeeping (seconds).
        scheduled: (request_id, num_prefill_tokens, num_decode_tokens) per request in the batch.
        num_blocks_used, num_blocks_free, num_blocks_cached: the pool after the step
            (a cached block with no owner counts as free and cached).
        preempted: ids of requests that lost their blocks this step.
        finished: ids of requests that finished this step.
        num_waiting, num_running: queue lengths after the step.
        num_kv_tokens: positions whose K/V the running requests hold after the step (a block
            shared by two requests counts for both): what a perfectly packed cache would store.
        tier_decisions: with KV tiers, each run of blocks a request found in host memory or on disk
            in this step, and whether it was loaded or recomputed, with both predicted times
            (:class:`~minillm.serving.kv_tiers.TierDecision`).
    """

    step: int
    start_s: float
    end_s: float
    scheduled: tuple[tuple[str, int, int], ...]
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    num_waiting: int = 0
    num_running: int = 0
    num_kv_tokens: int = 0
    tier_decisions: tuple = ()

    @property
    def time_ms(self) -> float:
        return (self.end_s - self.start_s) * 1e3

    @property
    def num_prefill_tokens(self) -> int:
        return sum(p for _, p, _ in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(d for _, _, d in self.scheduled)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


# -- one request's life as spans ------------------------------------------------------------------------
#
#   request 2:  |queued|prefill|decode|decode|x  queued  |prefill (recompute)|decode|decode|finished
#               arrival         first token  preempted                       (one span per step)
#
# Each span of work is the step it ran in (a request's tokens are computed in that step's one
# forward pass), clipped to the request's [arrival, finish]. A queued span ends where the step
# that picks the request up begins (first_scheduled_s itself falls inside that step, during its
# schedule()), so that no two spans of one request overlap.

QUEUED, PREFILL, DECODE = "queued", "prefill", "decode"


@dataclass(frozen=True)
class Span:
    """A stretch of one request's life.

    Attributes:
        kind: "queued" (waiting for a slot), "prefill" (prompt tokens, or a recompute after a
            preemption) or "decode" (one token per step).
        start_s, end_s: ``time.perf_counter()`` seconds.
        first_step, last_step: the engine steps it covers (None for "queued").
        num_tokens: tokens computed in it (0 for "queued").
        recompute: a prefill of a request that was preempted before (its K/V computed again).
    """

    kind: str
    start_s: float
    end_s: float
    first_step: int | None = None
    last_step: int | None = None
    num_tokens: int = 0
    recompute: bool = False


def request_spans(request, steps, merge: bool = False) -> list[Span]:
    """The queued, prefill and decode spans of one request, in time order.

    ``steps``: the engine's :class:`StepRecord` list; ``request``: a
    :class:`~minillm.serving.request.Request` (or anything with its id and timestamps).
    ``merge``: join spans of the same kind in consecutive steps (one "decode" bar
    instead of one per token), as a plot wants; the Chrome trace keeps one per step.
    """
    return _spans(request, _rows_by_request(steps).get(request.request_id, []), steps, merge)


def spans_by_request(steps, requests, merge: bool = False) -> dict[str, list[Span]]:
    """:func:`request_spans` of every request (``engine.requests``, a dict or a list), by id,
    with the steps read once (one pass over the steps, not one per request)."""
    requests = _request_list(requests)
    rows = _rows_by_request(steps)
    return {r.request_id: _spans(r, rows.get(r.request_id, []), steps, merge) for r in requests}


def _spans(request, rows, steps, merge: bool) -> list[Span]:
    spans = _queued_spans(request, rows, steps) + [_work_span(request, *row) for row in rows]
    spans.sort(key=lambda s: s.start_s)
    return _merged(spans) if merge else spans


def _request_list(requests) -> list:
    """``engine.requests`` (a dict id -> Request) or any iterable of requests, as a list."""
    return list(requests.values()) if isinstance(requests, dict) else list(requests)


def _rows_by_request(steps) -> dict[str, list[tuple[StepRecord, int, int]]]:
    """request id -> [(step, num_prefill_tokens, num_decode_tokens), ...] in step order."""
    rows: dict[str, list] = {}
    for step in steps:
        for request_id, n_prefill, n_decode in step.scheduled:
            rows.setdefault(request_id, []).append((step, n_prefill, n_decode))
    return rows


def _queued_spans(request, rows, steps) -> list[Span]:
    """From arrival, and from each preemption, until the next step that schedules the request
    (or its finish, or the end of the trace when it is still waiting)."""
    spans = []
    for begin in [request.arrival_s, *request.preempted_s]:
        later = [step for step, _, _ in rows if step.end_s > begin]
        if later:
            end = later[0].start_s
        elif request.finish_s is not None:
            end = request.finish_s
        else:
            end = steps[-1].end_s if steps else begin
        if end > begin:
            spans.append(Span(QUEUED, begin, end))
    return spans


def _work_span(request, step: StepRecord, n_prefill: int, n_decode: int) -> Span:
    start = max(step.start_s, request.arrival_s)
    end = step.end_s if request.finish_s is None else min(step.end_s, request.finish_s)
    recompute = n_prefill > 0 and any(p < step.start_s for p in request.preempted_s)
    return Span(PREFILL if n_prefill else DECODE, start, max(start, end), step.step, step.step,
                n_prefill or n_decode, recompute)


def _merged(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for span in spans:
        last = out[-1] if out else None
        if (last is not None and span.kind == last.kind != QUEUED and span.recompute == last.recompute
                and span.first_step == last.last_step + 1):
            out[-1] = Span(last.kind, last.start_s, span.end_s, last.first_step, span.last_step,
                           last.num_tokens + span.num_tokens, last.recompute)
        else:
            out.append(span)
    return out


def batch_label(step: StepRecord) -> str:
    """The batch of a step as "0:P32 1:D1 2:D1": request id, P(refill) or D(ecode), tokens."""
    return " ".join(f"{rid}:P{p}" if p else f"{rid}:D{d}" for rid, p, d in step.scheduled)


def step_kind(step: StepRecord) -> str:
    """"prefill", "decode", "prefill + decode" (a mixed batch, as chunked prefill makes) or "empty"."""
    kinds = [name for name, n in ((PREFILL, step.num_prefill_tokens), (DECODE, step.num_decode_tokens)) if n]
    return " + ".join(kinds) or "empty"


# -- the Chrome trace of a run ------------------------------------------------------------------------
#
#   pid 1 "minillm engine"
#     tid 0 scheduler      |prefill|decode|decode|prefill + decode|decode| ...   (one box per step)
#     tid 1 request 0      |q|prefill|decode|decode| ...                ^finished (length)
#     tid 2 request 1      |   queued   |prefill|decode| ...
#     counters: KV blocks {used, free, cached}, requests {running, waiting}, KV tokens {tokens},
#               batch tokens {prefill, decode}

PID = 1
SCHEDULER_TID = 0


def chrome_trace_events(steps, requests) -> list[dict]:
    """A serving run as Chrome trace events: open the file in https://ui.perfetto.dev.

    ``steps``: the engine's :class:`StepRecord` list (``engine.steps``); ``requests``: its
    requests (``engine.requests``, a dict or a list). One process "minillm engine":

    - track 0 "scheduler": one box per step, named by what it ran ("prefill", "decode",
      "prefill + decode", "empty"); args the batch ("0:P32 1:D1"), its prefill and decode
      tokens, the pool's blocks used/free/cached after it, who was preempted or finished;
    - track 1 + i "request <id>", one per request in the given order: "queued" (arrival to
      its first step, and after each preemption until it runs again), "prefill" and
      "decode" boxes (one per step it ran in), instants "first token", "preempted",
      "finished (<reason>)";
    - counters after each step: "KV blocks" {used, free, cached}, "requests" {running,
      waiting}, "KV tokens" {tokens}; from each step's start, "batch tokens" {prefill, decode}.

    Times: microseconds from the earliest arrival (or the first step, if earlier).
    """
    requests = _request_list(requests)
    t0 = min([r.arrival_s for r in requests] + [s.start_s for s in steps[:1]], default=0.0)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events = [process_name(PID, "minillm engine"), thread_name(PID, SCHEDULER_TID, "scheduler"),
              thread_sort_index(PID, SCHEDULER_TID, SCHEDULER_TID)]
    for step in steps:
        events += _step_events(step, us)
    spans = spans_by_request(steps, requests)
    for i, request in enumerate(requests):
        events += _request_events(request, 1 + i, spans[request.request_id], us)
    return events


def write_chrome_trace(path, steps, requests, metadata: dict | None = None) -> Path:
    """Write :func:`chrome_trace_events` to ``path`` (a .json file) and return the path.

    ``metadata`` (flat JSON values) is added to the file's ``otherData``, e.g. the engine's knobs.
    Raises ValueError as :func:`minillm.formats.trace_events.write` (bad events, a missing folder).
    """
    requests = _request_list(requests)
    data = {"generator": "minillm serving", "n_steps": len(steps), "n_requests": len(requests),
            "time_origin": "earliest arrival", **(metadata or {})}
    return write(path, chrome_trace_events(steps, requests), data)


def _step_events(step: StepRecord, us) -> list[dict]:
    args = {
        "step": step.step, "batch": batch_label(step), "num_seqs": len(step.scheduled),
        "num_prefill_tokens": step.num_prefill_tokens, "num_decode_tokens": step.num_decode_tokens,
        "num_blocks_used": step.num_blocks_used, "num_blocks_free": step.num_blocks_free,
        "num_blocks_cached": step.num_blocks_cached, "preempted": list(step.preempted),
        "finished": list(step.finished), "num_waiting": step.num_waiting, "num_running": step.num_running,
        "num_kv_tokens": step.num_kv_tokens, "time_ms": round(step.time_ms, 3),
    }
    if step.tier_decisions:  # both predicted numbers of each load-or-recompute choice
        args["tier_decisions"] = [
            {"request": d.request_id, "tier": d.tier, "blocks": d.num_blocks, "bytes": d.num_bytes,
             "load_ms": round(d.load_ms, 3), "recompute_ms": round(d.recompute_ms, 3), "choice": d.choice,
             "loaded_blocks": d.loaded_blocks} for d in step.tier_decisions]
    start, end = us(step.start_s), us(step.end_s)
    return [
        complete(step_kind(step), start, round(end - start, 3), PID, SCHEDULER_TID, "scheduler", args),
        counter("batch tokens", start, PID, {"prefill": step.num_prefill_tokens, "decode": step.num_decode_tokens}),
        counter("KV blocks", end, PID, {"used": step.num_blocks_used, "free": step.num_blocks_free,
                                        "cached": step.num_blocks_cached}),
        counter("requests", end, PID, {"running": step.num_running, "waiting": step.num_waiting}),
        counter("KV tokens", end, PID, {"tokens": step.num_kv_tokens}),
    ]


def _request_events(request, tid: int, spans: list[Span], us) -> list[dict]:
    events = [thread_name(PID, tid, f"request {request.request_id}"), thread_sort_index(PID, tid, tid)]
    for span in spans:
        start = us(span.start_s)
        args = {} if span.kind == QUEUED else {"step": span.first_step, "num_tokens": span.num_tokens}
        if span.recompute:
            args["recompute"] = True
        events.append(complete(span.kind, start, round(us(span.end_s) - start, 3), PID, tid, span.kind, args))
    if request.token_times_s:
        events.append(instant("first token", us(request.token_times_s[0]), PID, tid,
                              args={"ttft_ms": round((request.token_times_s[0] - request.arrival_s) * 1e3, 3)}))
    for n, t in enumerate(request.preempted_s, start=1):
        events.append(instant("preempted", us(t), PID, tid, args={"preemption": n}))
    if request.finish_s is not None:
        events.append(instant(f"finished ({request.finish_reason})", us(request.finish_s), PID, tid,
                              args=_request_summary(request)))
    return events


def _request_summary(request) -> dict:
    summary = {
        "num_prompt_tokens": request.num_prompt_tokens, "num_output_tokens": len(request.output_ids),
        "num_cached_tokens": request.num_cached_tokens, "num_preemptions": request.num_preemptions,
        "finish_reason": request.finish_reason, "e2e_ms": round((request.finish_s - request.arrival_s) * 1e3, 3),
    }
    if request.message:
        summary["message"] = request.message
    return summary
