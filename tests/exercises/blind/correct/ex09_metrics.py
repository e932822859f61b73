"""Exercise 9: TTFT, TPOT and throughput of one request, from timestamps.

Write ``RequestMetrics.from_timestamps``. The class inherits minillm's frozen dataclass:
return ``cls(...)`` with every field (see minillm/metrics.py for the list). The checks
grade ttft_ms, tpot_ms, itl_ms, e2e_ms and both throughputs; for the ITL percentiles use
``percentile`` (imported below); ``mbu`` may stay None.

Check:      minillm check ex09   (or: pytest tests/exercises -m ex09 --impl student)
Lesson:     lessons/06-metrics.md#ttft-and-tpot
Reference:  minillm.metrics.RequestMetrics.from_timestamps
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import math  # noqa: F401
from typing import Sequence

from minillm import metrics
from minillm.metrics import percentile  # noqa: F401


class RequestMetrics(metrics.RequestMetrics):
    """minillm's RequestMetrics dataclass (its fields); from_timestamps is yours."""

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
            raise ValueError("no tokens")
        if times[0] < start_s:
            raise ValueError("a token before the start")
        for a, b in zip(times, times[1:]):
            if b < a:
                raise ValueError("decreasing token times")
        n = len(times)
        ttft = times[0] - start_s
        e2e = times[-1] - start_s
        itl = tuple((b - a) * 1000.0 for a, b in zip(times, times[1:]))
        tpot = (e2e - ttft) / (n - 1) if n > 1 else None
        mbu = None
        if bytes_per_decode_step is not None and peak_bandwidth is not None and tpot is not None and tpot > 0:
            mbu = bytes_per_decode_step / tpot / peak_bandwidth
        return cls(
            n_prompt_tokens=n_prompt_tokens,
            n_output_tokens=n,
            ttft_ms=ttft * 1000.0,
            tpot_ms=tpot * 1000.0 if tpot is not None else None,
            itl_ms=itl,
            itl_p50_ms=percentile(itl, 50) if itl else None,
            itl_p90_ms=percentile(itl, 90) if itl else None,
            itl_p99_ms=percentile(itl, 99) if itl else None,
            e2e_ms=e2e * 1000.0,
            output_throughput_tok_s=n / e2e if e2e > 0 else math.inf,
            prefill_throughput_tok_s=n_prompt_tokens / ttft if ttft > 0 else math.inf,
            mbu=mbu,
        )
