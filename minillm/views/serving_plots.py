"""Plots of a serving run and of a rate sweep (matplotlib, no display needed).

    plot_timeline(requests, steps)   one row per request over wall time: queued, prefill, decode;
                                     first token, preemptions (red x) and finish marked
    plot_rate_sweep(rows)            throughput, goodput, TTFT and TPOT against the arrival rate,
                                     one line per scheduling policy, SLOs dashed
    plot_itl(itl_ms_by_policy)       inter-token latencies in order and as a CDF, p99 marked:
                                     what chunked prefill changes

Each function returns a ``matplotlib.figure.Figure`` built without pyplot (no global state,
no GUI backend); save it with ``fig.savefig(path)``.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from ..metrics import percentile
from ..serving.step_trace import DECODE, PREFILL, QUEUED, spans_by_request
from .plots import DECODE_COLOR, PREFILL_COLOR

SPAN_COLORS = {QUEUED: "0.82", PREFILL: PREFILL_COLOR, DECODE: DECODE_COLOR}
BAR_HEIGHT = 0.7
MAX_ROW_LABELS = 40  # more requests than this: the y axis gets plain tick numbers


def plot_timeline(requests, steps, title: str = "") -> Figure:
    """Each request's life as a row of bars over wall time (s from the first arrival).

    Bars: queued (grey: waiting for a slot, again after a preemption), prefill (orange,
    a recompute after a preemption hatched) and decode (blue); consecutive steps of one kind
    are one bar. Markers: first token (black dot), preempted (red x), finished (black bar end |).
    ``requests``: ``engine.requests`` (a dict) or a list; ``steps``: ``engine.steps``.
    Row i (from the top) is the i-th request, labelled with its id.
    """
    requests = list(requests.values()) if isinstance(requests, dict) else list(requests)
    fig = Figure(figsize=(9, min(2 + 0.3 * len(requests), 14)), layout="constrained")
    ax = fig.subplots()
    if not requests:
        ax.set_title(title or "Request timeline: no requests")
        return fig
    t0 = min([r.arrival_s for r in requests] + [s.start_s for s in steps[:1]])
    labelled: set[str] = set()

    def label(name: str) -> str | None:
        first = name not in labelled
        labelled.add(name)
        return name if first else None

    spans = spans_by_request(steps, requests, merge=True)
    for row, r in enumerate(requests):
        for span in spans[r.request_id]:
            name = "prefill (recompute)" if span.recompute else span.kind
            ax.barh(row, span.end_s - span.start_s, left=span.start_s - t0, height=BAR_HEIGHT,
                    color=SPAN_COLORS[span.kind], hatch="//" if span.recompute else None,
                    edgecolor="white" if not span.recompute else "0.3", linewidth=0.4, label=label(name))
        if r.token_times_s:
            ax.plot(r.token_times_s[0] - t0, row, "o", color="black", markersize=3, label=label("first token"))
        if r.preempted_s:
            ax.plot([t - t0 for t in r.preempted_s], [row] * len(r.preempted_s), "x", color="tab:red",
                    markersize=7, markeredgewidth=2, label=label("preempted"))
        if r.finish_s is not None:
            ax.plot(r.finish_s - t0, row, "|", color="black", markersize=10, markeredgewidth=1.5,
                    label=label("finished"))
    if len(requests) <= MAX_ROW_LABELS:
        ax.set_yticks(range(len(requests)), [f"request {r.request_id}" for r in requests], fontsize=7)
    ax.set_ylim(len(requests) - 0.5, -0.5)  # the first request on top
    ax.set_xlim(left=0)
    ax.set_xlabel("time since the first arrival (s)")
    ax.set_title(title or f"Request timeline: {len(requests)} requests, {len(steps)} engine steps")
    ax.grid(axis="x", color="0.9", linewidth=0.5)
    ax.set_axisbelow(True)
    fig.legend(loc="outside lower center", fontsize=7, ncols=7)
    return fig


# -- a sweep over arrival rates -----------------------------------------------------------------------

SWEEP_PANELS = (  # (title, y label, [(key, line style, label suffix)])
    ("Output throughput", "tok/s", [("output_throughput_tok_s", "-", "")]),
    ("Goodput (requests meeting the SLOs)", "req/s", [("goodput_req_s", "-", "")]),
    ("TTFT", "ms", [("p50_ttft_ms", "-", " p50"), ("p99_ttft_ms", ":", " p99")]),
    ("TPOT", "ms", [("p50_tpot_ms", "-", " p50"), ("p99_tpot_ms", ":", " p99")]),
)


def plot_rate_sweep(rows, ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> Figure:
    """Four panels against the arrival rate (req/s): output throughput, goodput, TTFT p50/p99,
    TPOT p50/p99; one colour per policy (p50 solid, p99 dotted); the SLOs as dashed red lines.

    ``rows``: dicts with ``policy``, ``rate_req_s`` and the keys of ``RunSummary.to_dict()``
    (a missing or None value is a gap in its line). A rate of None or inf (offline: all
    requests at once) is drawn right of the largest finite rate, at the tick "inf".
    The goodput panel also shows the offered load (goodput = rate, dotted grey): the most
    any policy could serve. Raises ValueError for no rows or a row without policy or rate.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("plot_rate_sweep: no rows; give one dict per (policy, rate) run")
    for i, row in enumerate(rows):
        if "policy" not in row or "rate_req_s" not in row:
            raise ValueError(f"row {i} needs 'policy' and 'rate_req_s' keys, has {sorted(row)}")
    x_of, ticks = _rate_axis([row["rate_req_s"] for row in rows])
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    colors = {p: f"C{i % 10}" for i, p in enumerate(policies)}
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).ravel()
    for ax, (panel, unit, series) in zip(axes, SWEEP_PANELS):
        for policy in policies:
            mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: x_of(r["rate_req_s"]))
            xs = [x_of(r["rate_req_s"]) for r in mine]
            for key, style, suffix in series:
                ys = [_value(r.get(key)) for r in mine]
                ax.plot(xs, ys, style, marker="o", markersize=4, color=colors[policy], label=f"{policy}{suffix}")
        ax.set_title(panel, fontsize=10)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(color="0.9", linewidth=0.5)
    finite = [r["rate_req_s"] for r in rows if r["rate_req_s"] is not None and math.isfinite(r["rate_req_s"])]
    if finite:  # the offered load: no policy serves more requests than arrive
        top = max(finite)
        axes[1].plot([0, top], [0, top], ":", color="0.6", label="offered load")
    axes[0].set_xlim(left=0)
    _slo_line(axes[2], ttft_slo_ms, "TTFT SLO")
    _slo_line(axes[3], tpot_slo_ms, "TPOT SLO")
    for ax in axes[2:]:
        ax.set_xlabel("arrival rate (req/s)")
        if ticks:
            ax.set_xticks(*ticks)
    for ax in axes:
        ax.legend(fontsize=7)
    return fig


def _rate_axis(rates) -> tuple:
    """The x position of a rate, and the ticks (positions, labels) when some rate is offline
    (None or inf: placed at 1.25 x the largest finite rate, labelled "inf"), else None."""
    finite = sorted({r for r in rates if r is not None and math.isfinite(r)})
    x_inf = 1.25 * max(finite) if finite else 1.0

    def x_of(r):
        return x_inf if r is None or not math.isfinite(r) else r

    if len(finite) == len({x_of(r) for r in rates}):
        return x_of, None
    return x_of, (finite + [x_inf], [f"{r:g}" for r in finite] + ["inf"])


def _value(v) -> float:
    return math.nan if v is None else float(v)


def _slo_line(ax, slo_ms: float | None, name: str) -> None:
    if slo_ms is not None:
        ax.axhline(slo_ms, linestyle="--", color="tab:red", linewidth=1, label=f"{name} {slo_ms:g} ms")


# -- inter-token latency ------------------------------------------------------------------------------


def plot_itl(itl_ms_by_policy: dict[str, list[float]], title: str = "") -> Figure:
    """Inter-token latencies (ms) of each policy: in the order given (left; pass them in time
    order to see where the spikes fall) and as a CDF (right), each policy's p99 a dotted line.

    Without chunked prefill, a decode that shares its step with a long prompt waits for the
    whole prefill: the spikes on the left, the long tail on the right. ``itl_ms_by_policy``:
    policy name -> every inter-token gap of the run (e.g. the ``itl_ms`` of each request's
    metrics, pooled). Policies with no gaps are left out. Raises ValueError if none has any.
    """
    series = {name: list(v) for name, v in itl_ms_by_policy.items() if len(v)}
    if not series:
        raise ValueError("plot_itl: no inter-token latencies; a run needs requests with 2+ output tokens")
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    in_order, cdf = fig.subplots(1, 2)
    for i, (name, itl) in enumerate(series.items()):
        color = f"C{i % 10}"
        p99 = percentile(itl, 99)
        in_order.plot(range(len(itl)), itl, color=color, linewidth=0.8, label=name)
        ordered = sorted(itl)
        cdf.plot(ordered, [(k + 1) / len(ordered) for k in range(len(ordered))], color=color,
                 drawstyle="steps-post", label=name)
        cdf.axvline(p99, color=color, linestyle=":", linewidth=1.2, label=f"{name} p99 {p99:.1f} ms")
    in_order.set_xlabel("inter-token gap, in order")
    in_order.set_ylabel("ITL (ms)")
    in_order.set_ylim(bottom=0)
    in_order.set_title("ITL over the run", fontsize=10)
    cdf.set_xlabel("ITL (ms)")
    cdf.set_ylabel("fraction of gaps <= x")
    cdf.set_ylim(0, 1.02)
    cdf.set_title("ITL CDF", fontsize=10)
    for ax in (in_order, cdf):
        ax.grid(color="0.9", linewidth=0.5)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return fig


__all__ = ["plot_itl", "plot_rate_sweep", "plot_timeline"]
