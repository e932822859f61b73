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
        raise NotImplementedError(
            "Exercise 9 (metrics) is not written yet: see lessons/06-metrics.md#ttft-and-tpot"
        )
