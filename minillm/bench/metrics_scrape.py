"""A server's own latencies, read from its Prometheus ``/metrics`` before and after a run.

A server's histograms and counters add up everything since it started, so a run's own
numbers are the difference of two scrapes, one before the run and one after::

    scrape before ──── the run ────> scrape after
    Δcount = count_after - count_before       (requests, or tokens for ITL)
    Δsum   = sum_after - sum_before           (seconds)
    mean   = Δsum / Δcount                    exact
    p50, p90, p99                             estimated from the Δbuckets

Percentiles are estimated the way Prometheus's ``histogram_quantile()`` does: find the
bucket that holds rank q·Δcount and interpolate linearly inside it, as if its
observations were spread evenly between the bucket's bounds::

    le (s)        0.025   0.05   0.1   +Inf
    Δ cumulative      2      6    10     10      p50: rank 5 lies in (0.025, 0.05], which
                                                 holds ranks 3..6: 0.025 + 0.025·(5-2)/4 = 0.04375 s

so an estimate is only as fine as the server's buckets (a p50 in (0.5, 1] s is known to
that bucket), and a rank in the +Inf bucket gives the highest finite bound.

Metric names are vLLM's (``vllm:time_to_first_token_seconds``, ...); minillm's server
uses them under a ``minillm:`` prefix. :func:`scrape_delta` tries ``minillm:`` and then
``vllm:`` and says so when neither is there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PREFIXES = ("minillm:", "vllm:")
# latency -> histogram names (seconds), first found wins: vLLM renamed time_per_output_token to
# inter_token_latency (v0.9); both are observed once per output token after the first.
LATENCY_HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds",),
    "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e": ("e2e_request_latency_seconds",),
}
COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "request_success_total",
            "prefix_cache_queries_total", "prefix_cache_hits_total")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (sample name, sorted labels) -> value


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by (name, sorted label pairs).

    Parsed with ``prometheus_client``'s own text parser. Raises ValueError for text that
    is not the Prometheus text format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"/metrics is not in the Prometheus text format: {e}") from None
    return samples


def _total(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of every sample called ``name`` whose labels include ``labels`` (None if none)."""
    values = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab)]
    return sum(values) if values else None


def _by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label`` (e.g. requests per finished_reason)."""
    out: dict[str, float] = {}
    for (n, lab), v in samples.items():
        if n == name:
            key = dict(lab).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


@dataclass(frozen=True)
class HistogramDelta:
    """One histogram's growth between two scrapes.

    Attributes:
        name: the full metric name (e.g. ``minillm:time_to_first_token_seconds``).
        buckets: (upper bound ``le`` in the metric's unit, cumulative count), ascending, +Inf last.
        count: observations added; sum: their total (the metric's unit, seconds here).
    """

    name: str
    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Prometheus's ``histogram_quantile(q, ...)`` on these buckets (None with no observations)."""
        return histogram_quantile(q, self.buckets)


def histogram_delta(before: Samples, after: Samples, name: str) -> HistogramDelta | None:
    """``after - before`` of histogram ``name`` (its _bucket, _sum, _count samples, summed over
    labels other than ``le``); None when ``after`` has no such histogram."""
    count_after = _total(after, f"{name}_count")
    if count_after is None:
        return None
    bounds = sorted({float(dict(lab)["le"]) for (n, lab) in after if n == f"{name}_bucket"})
    buckets = tuple((le, _delta(before, after, f"{name}_bucket", le=_le_text(after, name, le))) for le in bounds)
    return HistogramDelta(name, buckets, _delta(before, after, f"{name}_count"), _delta(before, after, f"{name}_sum"))


def _le_text(samples: Samples, name: str, le: float) -> str:
    """The ``le`` label as the server wrote it ("0.1", "+Inf") for a bound read as a float."""
    return next(dict(lab)["le"] for (n, lab) in samples if n == f"{name}_bucket" and float(dict(lab)["le"]) == le)


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return (_total(after, name, **labels) or 0.0) - (_total(before, name, **labels) or 0.0)


def histogram_quantile(q: float, buckets) -> float | None:
    """The q-quantile (0 <= q <= 1) of cumulative ``buckets`` [(le, count), ..., (inf, count)],
    as Prometheus's ``histogram_quantile``: linear inside the bucket holding rank q·total, the
    first bucket starting at 0, a rank in the +Inf bucket giving the highest finite bound.

    None when the buckets hold no observation. Raises ValueError for q outside [0, 1].
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, count_below = 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= rank and cumulative > count_below:
            if math.isinf(le):
                return lower  # Prometheus: the upper bound of the last finite bucket
            return lower + (le - lower) * (rank - count_below) / (cumulative - count_below)
        lower, count_below = le, cumulative
    return lower


@dataclass
class ServerSideNumbers:
    """A run as the server measured it (from two /metrics scrapes).

    Attributes:
        prefix: "minillm:" or "vllm:", the names found; None when neither was there.
        latencies: "ttft", "itl", "e2e" -> the histogram's :class:`HistogramDelta` (missing
            names left out). Seconds, as Prometheus keeps them.
        counters: counter name without prefix -> its growth during the run (e.g.
            "generation_tokens_total": output tokens); "request_success_total" split per
            finished_reason as "request_success_total{length}".
        note: why something is missing, for the report (empty when all was found).
    """

    prefix: str | None
    latencies: dict[str, HistogramDelta] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def stats_ms(self, latency: str) -> dict[str, float | None]:
        """mean (exact), p50, p90, p99 (bucket estimates) of one latency, in ms; {} if missing."""
        h = self.latencies.get(latency)
        if h is None:
            return {}
        ms = lambda s: None if s is None else s * 1e3  # noqa: E731
        return {"count": h.count, "mean": ms(h.mean), **{f"p{p}": ms(h.quantile(p / 100)) for p in (50, 90, 99)}}

    def to_dict(self) -> dict:
        return {"prefix": self.prefix, "note": self.note, "counters": self.counters,
                "latencies_ms": {k: self.stats_ms(k) for k in self.latencies}}


def scrape_delta(before_text: str, after_text: str) -> ServerSideNumbers:
    """The run's server-side latencies and counters: ``after - before`` of two /metrics texts.

    Looks for vLLM's names under ``minillm:``, then ``vllm:``. Raises ValueError for text
    that is not the Prometheus format.
    """
    before, after = parse_metrics(before_text), parse_metrics(after_text)
    prefix = next((p for p in PREFIXES if _total(after, f"{p}{LATENCY_HISTOGRAMS['ttft'][0]}_count") is not None), None)
    if prefix is None:
        return ServerSideNumbers(None, note="/metrics has no minillm: or vllm: latency histograms; "
                                            "server-side numbers skipped")
    out = ServerSideNumbers(prefix)
    for latency, names in LATENCY_HISTOGRAMS.items():
        h = next((h for n in names if (h := histogram_delta(before, after, prefix + n)) is not None), None)
        if h is not None:
            out.latencies[latency] = h
    for name in COUNTERS:
        if _total(after, prefix + name) is None:
            continue
        out.counters[name] = _delta(before, after, prefix + name)
        if name == "request_success_total":
            was = _by_label(before, prefix + name, "finished_reason")
            for reason, value in _by_label(after, prefix + name, "finished_reason").items():
                out.counters[f"{name}{{{reason}}}"] = value - was.get(reason, 0.0)
    missing = [k for k in LATENCY_HISTOGRAMS if k not in out.latencies]
    if missing:
        out.note = f"/metrics has no {', '.join(missing)} histogram under {prefix}"
    return out
