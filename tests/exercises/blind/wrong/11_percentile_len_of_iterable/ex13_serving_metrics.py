"""Exercise 13: percentiles, SLO attainment and goodput over many requests.

A service is judged on the distribution of its requests' metrics, not on one request.
Write ``percentile`` (linear interpolation between closest ranks, without numpy: sort,
find the fractional rank (n - 1) · p / 100, interpolate between its two neighbours),
``slo_attainment`` (the fraction of requests meeting every given SLO) and ``goodput``
(requests per second meeting them). Each request is a minillm ``RequestMetrics``
(build one with ``RequestMetrics.from_timestamps``); the checks read ``ttft_ms`` and
``tpot_ms`` only.

Check:      minillm check ex13   (or: pytest tests/exercises -m ex13 --impl student)
Lesson:     lessons/06-metrics.md#percentiles, lessons/06-metrics.md#slos
Reference:  minillm.metrics.percentile, slo_attainment, goodput
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

from typing import Iterable, Sequence

from minillm.metrics import RequestMetrics


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100) with linear interpolation between
    closest ranks (``numpy.percentile``'s default, as vLLM's benchmark uses).

    percentile([1, 2, 3, 4], 50) == 2.5. Raises ValueError for no values or p outside [0, 100].
    """
    if not 0 <= p <= 100:
        raise ValueError(f"p must be in [0, 100], got {p}")
    if len(values) == 0:
        raise ValueError("no values")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    frac = rank - lo
    return float(xs[lo] + (xs[hi] - xs[lo]) * frac)


def slo_attainment(
    metrics_list: Sequence[RequestMetrics], ttft_ms: float | None = None, tpot_ms: float | None = None
) -> float:
    """Fraction of requests (0..1) meeting every given SLO: TTFT <= ttft_ms and TPOT <= tpot_ms.

    E.g. the SLO "TTFT under 1 s for 99% of requests" holds when
    ``slo_attainment(ms, ttft_ms=1000) >= 0.99``. A one-token request has no TPOT
    and meets any TPOT SLO; an SLO left as None is not checked.
    Raises ValueError for an empty list.
    """
    if not metrics_list:
        raise ValueError("no requests")
    ok = 0
    for m in metrics_list:
        if ttft_ms is not None and not m.ttft_ms <= ttft_ms:
            continue
        if tpot_ms is not None and m.tpot_ms is not None and not m.tpot_ms <= tpot_ms:
            continue
        ok += 1
    return ok / len(metrics_list)


def goodput(
    metrics_list: Sequence[RequestMetrics], duration_s: float, ttft_ms: float | None = None,
    tpot_ms: float | None = None,
) -> float:
    """Requests per second that met every given SLO: (requests meeting them) / duration_s.

    Throughput counts every finished request; goodput only those served well enough.
    This is the per-run goodput of vLLM's ``benchmark_serving.py --goodput`` (reported as
    ``request_goodput``, req/s). DistServe (Zhong et al. 2024) names a different number
    goodput: the highest request rate at which SLO attainment stays on target (say 90 %);
    sweep the request rate with this function to find it. A request meets the SLOs as in
    :func:`slo_attainment` (TTFT <= ttft_ms and TPOT <= tpot_ms; a one-token request meets
    any TPOT SLO), so goodput = slo_attainment · len(metrics_list) / duration_s.

    Args:
        metrics_list: the requests of one benchmark run.
        duration_s: the run's wall-clock time, first request sent to last token (s).
        ttft_ms, tpot_ms: the SLOs (ms); None: not checked.

    Raises ValueError for an empty list or duration_s <= 0.
    """
    if not metrics_list:
        raise ValueError("no requests")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    return slo_attainment(metrics_list, ttft_ms, tpot_ms) * len(metrics_list) / duration_s
