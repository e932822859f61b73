"""Per-request latency metrics, named and defined as serving benchmarks define them.

Conventions of vLLM's ``benchmarks/benchmark_serving.py`` and NVIDIA GenAI-Perf
("GenAI-Perf metrics" in its documentation), for one request that starts at
``start`` and receives tokens at t_1 < t_2 < ... < t_n:

    start        t_1         t_2    t_3          t_n
      |-- TTFT --|--itl_1--|-itl_2-| ... |-itl-|
      |<------------------- e2e ------------------>|

    TTFT  = t_1 - start                       time to first token: queue + prefill + 1st sample
    ITL_i = t_{i+1} - t_i                     inter-token latency, one per decode step
    TPOT  = (e2e - TTFT) / (n - 1) = mean(ITL) time per output token after the first
    e2e   = t_n - start = TTFT + TPOT · (n - 1)
    output throughput  = n / e2e              tok/s of this request
    prefill throughput = n_prompt / TTFT      tok/s the prompt was processed at

A request with a single output token has no TPOT: ``tpot_ms`` is None and the
ITL statistics are None (vLLM likewise leaves such requests out of its TPOT mean).
All latencies are in milliseconds; timestamps come from ``time.perf_counter()`` (s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class RequestMetrics:
    """Latency and throughput of one request.

    Attributes:
        n_prompt_tokens, n_output_tokens: token counts.
        ttft_ms: request start to first output token (ms).
        tpot_ms: (e2e - ttft) / (n_output_tokens - 1), ms; None when n_output_tokens == 1.
        itl_ms: every inter-token gap, in order (ms); empty for one token.
        itl_p50_ms, itl_p90_ms, itl_p99_ms: percentiles of itl_ms (None when empty).
        e2e_ms: request start to last token (ms).
        output_throughput_tok_s: n_output_tokens / e2e (tok/s).
        prefill_throughput_tok_s: n_prompt_tokens / ttft (tok/s).
        mbu: model bandwidth utilisation, bytes_per_decode_step / TPOT / peak bandwidth
            (Databricks 2023, "LLM Inference Performance Engineering: Best Practices"),
            in [0, 1] when the byte count and peak are right; None unless both were given
            and there is a TPOT.
    """

    n_prompt_tokens: int
    n_output_tokens: int
    ttft_ms: float
    tpot_ms: float | None
    itl_ms: tuple[float, ...]
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    e2e_ms: float
    output_throughput_tok_s: float
    prefill_throughput_tok_s: float
    mbu: float | None = None

    @classmethod
    def from_timestamps(
        cls,
        start_s: float,
        token_times_s: Sequence[float],
        n_prompt_tokens: int,
        bytes_per_decode_step: float | None = None,
        peak_bandwidth: float | None = None,
    ) -> "RequestMetrics":
        """Metrics of one request from its start time and each token's arrival time.

        Args:
            start_s: when the request started (``time.perf_counter()``, s).
            token_times_s: when each output token was known, non-decreasing, >= start_s (s);
                e.g. ``[step.time_s for step in generate(...)]``.
            n_prompt_tokens: prompt length (tokens).
            bytes_per_decode_step: bytes one decode step reads and writes (weights + KV),
                e.g. ``decode_cost(...).bytes`` at the mean context; enables ``mbu``.
            peak_bandwidth: the device's memory bandwidth (bytes/s); enables ``mbu``.

        Raises ValueError for no tokens, decreasing times or a token before the start.
        """
        times = [float(t) for t in token_times_s]
        if not times:
            raise ValueError("token_times_s is empty; a request needs at least one output token")
        if times[0] < start_s:
            raise ValueError(f"first token at {times[0]} s is before the request start {start_s} s")
        if any(b < a for a, b in zip(times, times[1:])):
            raise ValueError("token_times_s must be non-decreasing (perf_counter timestamps in order)")
        n_out = len(times)
        ttft_ms = (times[0] - start_s) * 1e3
        e2e_ms = (times[-1] - start_s) * 1e3
        itl = tuple((b - a) * 1e3 for a, b in zip(times, times[1:]))
        tpot_ms = (e2e_ms - ttft_ms) / (n_out - 1) if n_out > 1 else None
        mbu = None
        if tpot_ms and bytes_per_decode_step is not None and peak_bandwidth:
            mbu = bytes_per_decode_step / (tpot_ms / 1e3) / peak_bandwidth
        return cls(
            n_prompt_tokens=n_prompt_tokens,
            n_output_tokens=n_out,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            itl_ms=itl,
            itl_p50_ms=percentile(itl, 50) if itl else None,
            itl_p90_ms=percentile(itl, 90) if itl else None,
            itl_p99_ms=percentile(itl, 99) if itl else None,
            e2e_ms=e2e_ms,
            output_throughput_tok_s=_rate(n_out, e2e_ms),
            prefill_throughput_tok_s=_rate(n_prompt_tokens, ttft_ms),
            mbu=mbu,
        )


def _rate(n: int, ms: float) -> float:
    """n per second over ms milliseconds (inf for a zero interval)."""
    return n / (ms / 1e3) if ms > 0 else math.inf


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100) with linear interpolation between
    closest ranks (``numpy.percentile``'s default, as vLLM's benchmark uses).

    percentile([1, 2, 3, 4], 50) == 2.5. Raises ValueError for no values or p outside [0, 100].
    """
    values = list(values)
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be in [0, 100], got {p}")
    return float(np.percentile(values, p))


SUMMARY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def summarize(metrics_list: Sequence[RequestMetrics]) -> dict[str, float | int | None]:
    """Distribution of latencies across requests, flat keys like vLLM's benchmark output.

    Keys: n_requests, total_input_tokens, total_output_tokens, and for each of
    ttft_ms, tpot_ms, itl_ms, e2e_ms: mean_<m>, p50_<m>, p90_<m>, p99_<m>.
    tpot_ms is over requests with more than one token; itl_ms pools every gap of
    every request. A statistic with no values is None.
    Raises ValueError for an empty list.
    """
    if not metrics_list:
        raise ValueError("summarize: no requests")
    samples = {
        "ttft_ms": [m.ttft_ms for m in metrics_list],
        "tpot_ms": [m.tpot_ms for m in metrics_list if m.tpot_ms is not None],
        "itl_ms": [gap for m in metrics_list for gap in m.itl_ms],
        "e2e_ms": [m.e2e_ms for m in metrics_list],
    }
    out: dict[str, float | int | None] = {
        "n_requests": len(metrics_list),
        "total_input_tokens": sum(m.n_prompt_tokens for m in metrics_list),
        "total_output_tokens": sum(m.n_output_tokens for m in metrics_list),
    }
    for name, values in samples.items():
        out[f"mean_{name}"] = float(np.mean(values)) if values else None
        for p in (50, 90, 99):
            out[f"p{p}_{name}"] = percentile(values, p) if values else None
    return out


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
        raise ValueError("slo_attainment: no requests")

    def ok(m: RequestMetrics) -> bool:
        ttft_ok = ttft_ms is None or m.ttft_ms <= ttft_ms
        tpot_ok = tpot_ms is None or m.tpot_ms is None or m.tpot_ms <= tpot_ms
        return ttft_ok and tpot_ok

    return sum(ok(m) for m in metrics_list) / len(metrics_list)


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
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0 seconds, got {duration_s}")
    return slo_attainment(metrics_list, ttft_ms, tpot_ms) * len(metrics_list) / duration_s
