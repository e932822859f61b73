"""Metrics of a whole serving run: many requests sharing one engine.

:mod:`minillm.metrics` measures one request from its start. In a server a request
first waits in a queue, so its clock starts when it *arrives*, not when the engine
picks it up; the wait is part of what its user feels::

    arrival   first scheduled     t_1        t_2          t_n
       |-- queue --|-- prefill --|--itl_1--|  ...  |-itl-|
       |<--------- TTFT -------->|                        |
       |<----------------------- e2e -------------------->|

    queue_ms = first_scheduled - arrival      waiting for a slot (KV blocks, batch room)
    TTFT, TPOT, ITL, e2e                      as minillm.metrics, measured from arrival

A run is then summed up the way vLLM's ``benchmarks/benchmark_serving.py``
(``calculate_metrics``) does, over a wall-clock ``duration_s``:

    request throughput   = completed requests / duration_s                   (req/s)
    output throughput    = output tokens / duration_s                        (tok/s)
    total token through. = (prompt + output tokens) / duration_s             (tok/s)
    mean, p50, p90, p99  of TTFT, TPOT, ITL (all gaps pooled), e2e, queue    (ms)
    SLO attainment       = fraction of all requests with TTFT <= ttft_slo_ms and
                           TPOT <= tpot_slo_ms (an aborted request meets neither)
    goodput              = requests meeting both SLOs / duration_s           (req/s)
                           (DistServe, Zhong et al. 2024; vLLM's --goodput)

Throughput alone rewards a server that accepts everything and answers late; goodput
counts only the requests served well enough. Requests with ``finish_reason`` "abort" or "error"
(cancelled, dropped for want of KV blocks, or failed on their own part) are counted (``n_aborted``) but left out
of every latency and throughput figure, as vLLM leaves out failed requests; they count
as SLO misses, so dropping requests cannot raise the attainment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Iterable, Sequence

import numpy as np

from ..metrics import RequestMetrics, goodput, percentile, slo_attainment, summarize

STATS = ("mean", "p50", "p90", "p99")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms")
UNSERVED = ("abort", "error")  # finish reasons of requests left out of the latencies, counted in n_aborted


@dataclass(frozen=True)
class ServingRequestMetrics(RequestMetrics):
    """:class:`minillm.metrics.RequestMetrics` measured from the request's arrival, plus:

    Attributes:
        queue_ms: arrival to first scheduled (ms), the wait before any prefill.
        num_preemptions: times the scheduler pushed it back to waiting.
        num_cached_tokens: prompt tokens the prefix cache served (not prefilled).
    """

    queue_ms: float = 0.0
    num_preemptions: int = 0
    num_cached_tokens: int = 0


def request_metrics(req) -> ServingRequestMetrics:
    """Metrics of one finished request (duck-typed, as the engine's ``Request``).

    Reads ``req.arrival_s``, ``req.first_scheduled_s``, ``req.token_times_s`` (all
    ``time.perf_counter()`` seconds), ``req.num_prompt_tokens``, and, when present,
    ``req.num_preemptions`` and ``req.num_cached_tokens`` (default 0).

    Raises ValueError for a request with no output tokens, first_scheduled_s None
    or before arrival_s, or tokens out of order (as ``RequestMetrics.from_timestamps``).
    """
    if req.first_scheduled_s is None:
        raise ValueError("first_scheduled_s is None: the request never ran; only finished requests have metrics")
    queue_s = req.first_scheduled_s - req.arrival_s
    if queue_s < 0:
        raise ValueError(f"first_scheduled_s {req.first_scheduled_s} s is before arrival_s {req.arrival_s} s")
    base = RequestMetrics.from_timestamps(req.arrival_s, req.token_times_s, req.num_prompt_tokens)
    return ServingRequestMetrics(
        **{f.name: getattr(base, f.name) for f in fields(RequestMetrics)},
        queue_ms=queue_s * 1e3,
        num_preemptions=getattr(req, "num_preemptions", 0),
        num_cached_tokens=getattr(req, "num_cached_tokens", 0),
    )


@dataclass(frozen=True)
class RunSummary:
    """A serving run in numbers; every name carries its unit (see the module docstring).

    Counts: n_requests (all, aborted included), n_completed, n_aborted,
    total_input_tokens and total_output_tokens (completed requests), total_cached_tokens
    (prompt tokens of completed requests served by the prefix cache), n_preemptions
    (every request, aborted included: the preemptions happened either way).
    Latency statistics (ms) are None when no completed request has a value
    (e.g. TPOT when every request produced one token). ttft_slo_ms / tpot_slo_ms:
    the SLOs checked; slo_attainment (0..1, of all requests: aborted ones are misses) and
    goodput_req_s are None when no SLO was given.
    """

    n_requests: int
    n_completed: int
    n_aborted: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    n_preemptions: int
    request_throughput_req_s: float
    output_throughput_tok_s: float
    total_token_throughput_tok_s: float
    mean_ttft_ms: float | None
    p50_ttft_ms: float | None
    p90_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    p50_tpot_ms: float | None
    p90_tpot_ms: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    p50_itl_ms: float | None
    p90_itl_ms: float | None
    p99_itl_ms: float | None
    mean_e2e_ms: float | None
    p50_e2e_ms: float | None
    p90_e2e_ms: float | None
    p99_e2e_ms: float | None
    mean_queue_ms: float | None
    p50_queue_ms: float | None
    p90_queue_ms: float | None
    p99_queue_ms: float | None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    slo_attainment: float | None = None
    goodput_req_s: float | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        """Flat keys like vLLM's benchmark JSON: ``mean_ttft_ms``, ``p99_itl_ms``, ..."""
        return asdict(self)


def summarize_run(
    requests: Iterable, duration_s: float, ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None
) -> RunSummary:
    """Throughput, latency distributions and SLO attainment of one serving run.

    Args:
        requests: the run's finished requests (duck-typed, see :func:`request_metrics`);
            those with ``finish_reason`` "abort" or "error" are counted, and as SLO misses.
        duration_s: the run's wall-clock time, first request sent to last token (s);
            e.g. :func:`span_s` of the requests.
        ttft_slo_ms, tpot_slo_ms: SLOs for slo_attainment and goodput (ms); None: not checked.

    Raises ValueError for no requests, duration_s <= 0, or a completed request that
    :func:`request_metrics` rejects (the message names its index).
    """
    requests = list(requests)
    if not requests:
        raise ValueError("summarize_run: no requests; pass the engine's finished requests")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0 s (the run's wall-clock time, e.g. span_s(requests)), "
                         f"got {duration_s}")
    done = [r for r in requests if r.finish_reason not in UNSERVED]
    metrics = [_metrics_of(i, r) for i, r in enumerate(requests) if r.finish_reason not in UNSERVED]
    n_in = sum(m.n_prompt_tokens for m in metrics)
    n_out = sum(m.n_output_tokens for m in metrics)
    return RunSummary(
        n_requests=len(requests),
        n_completed=len(done),
        n_aborted=len(requests) - len(done),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        total_cached_tokens=sum(m.num_cached_tokens for m in metrics),
        n_preemptions=sum(getattr(r, "num_preemptions", 0) for r in requests),
        request_throughput_req_s=len(done) / duration_s,
        output_throughput_tok_s=n_out / duration_s,
        total_token_throughput_tok_s=(n_in + n_out) / duration_s,
        **_latency_stats(metrics),
        **_slo_stats(metrics, len(requests), duration_s, ttft_slo_ms, tpot_slo_ms),
    )


def _metrics_of(i: int, req) -> ServingRequestMetrics:
    """request_metrics(req), its errors prefixed with the request's index in the run."""
    try:
        return request_metrics(req)
    except ValueError as e:
        raise ValueError(f"request {i} (finish_reason={req.finish_reason!r}): {e}") from None


def _latency_stats(metrics: Sequence[ServingRequestMetrics]) -> dict[str, float | None]:
    """mean/p50/p90/p99 of every latency; None where there are no values."""
    if not metrics:
        return {f"{s}_{m}": None for m in LATENCIES for s in STATS}
    out = {k: v for k, v in summarize(metrics).items() if k.endswith("_ms")}
    queue = [m.queue_ms for m in metrics]
    out["mean_queue_ms"] = float(np.mean(queue))
    out.update({f"p{p}_queue_ms": percentile(queue, p) for p in (50, 90, 99)})
    return out


def _slo_stats(
    metrics, n_requests: int, duration_s: float, ttft_slo_ms: float | None, tpot_slo_ms: float | None
) -> dict:
    """SLO fields of :class:`RunSummary`: attainment (over all n_requests) and goodput; None without SLOs."""
    out = {"ttft_slo_ms": ttft_slo_ms, "tpot_slo_ms": tpot_slo_ms, "slo_attainment": None, "goodput_req_s": None}
    if ttft_slo_ms is None and tpot_slo_ms is None:
        return out
    if not metrics:
        return {**out, "slo_attainment": 0.0, "goodput_req_s": 0.0}
    n_met = slo_attainment(metrics, ttft_slo_ms, tpot_slo_ms) * len(metrics)
    out["slo_attainment"] = n_met / n_requests  # aborted requests are misses
    out["goodput_req_s"] = goodput(metrics, duration_s, ttft_slo_ms, tpot_slo_ms)
    return out


def span_s(requests: Iterable) -> float:
    """Wall-clock span of a run (s): first arrival to last output token of any request.

    A duration for :func:`summarize_run` when the caller did not time the run itself.
    Raises ValueError when no request has an output token.
    """
    requests = list(requests)
    last = [r.token_times_s[-1] for r in requests if r.token_times_s]
    if not last:
        raise ValueError("span_s: no request has an output token")
    return max(last) - min(r.arrival_s for r in requests)
