"""Plots of a trace and of a sweep (matplotlib, no display needed).

    timeline(trace)                 one request in time: tokenize, the prefill bar, a tick per decode step
    roofline(trace)                 the machine's roofline with this run's prefill and decode points
    kv_cache(trace)                 KV cache bytes against position
    ttft_vs_prompt_length(sweep)    TTFT grows with the prompt (prefill: compute)
    tpot_vs_context_length(sweep)   TPOT grows slowly with the context (decode: weights + KV reads)

Each function returns a ``matplotlib.figure.Figure`` (built without pyplot, so no global
state and no GUI backend) and saves it when given ``path``.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from ..trace import Trace
from ..units import fmt_bytes

PREFILL_COLOR, DECODE_COLOR, ROOF_COLOR = "tab:orange", "tab:blue", "0.3"


def timeline(trace: Trace, path=None) -> Figure:
    """Request timeline: bars for tokenize and prefill, one tick per decode step, TTFT marked."""
    fig = Figure(figsize=(9, 3), layout="constrained")
    ax = fig.subplots()
    tok = trace.first("tokenize")
    if tok is not None:
        ax.barh(1, tok["time_ms"], left=tok["start_ms"], color="tab:green", label="tokenize")
    for i, e in enumerate(trace.of("prefill")):
        ax.barh(1, e["time_ms"], left=e["start_ms"], color=PREFILL_COLOR, label="prefill" if i == 0 else None)
    decode = trace.decode_steps
    if decode:
        ax.barh([0] * len(decode), [e["time_ms"] for e in decode], left=[e["start_ms"] for e in decode],
                color=DECODE_COLOR, edgecolor="white", linewidth=0.5, label="decode steps")
    ends = [e["end_ms"] for e in trace.steps if "next_token_id" in e]
    if ends:
        ax.vlines(ends, -0.45, 1.45, color="0.2", linewidth=0.6, label="token known")
        ax.axvline(ends[0], color="tab:red", linestyle="--", linewidth=1, label=f"TTFT {ends[0]:.0f} ms")
    ax.set_yticks([0, 1], ["decode", "prefill"])
    ax.set_xlabel("time since request start (ms)")
    ax.set_title("Request timeline")
    fig.legend(loc="outside lower center", fontsize=7, ncols=5)
    return _save(fig, path)


def roofline(trace: Trace, hw=None, path=None) -> Figure:
    """Log-log roofline: attainable FLOP/s = min(peak, intensity x bandwidth), with the run's points.

    ``hw``: a :class:`~minillm.hardware.HardwareProfile`; default the one the trace's
    roofline events were measured against. Raises ValueError when there is neither.
    """
    peak, bandwidth, name = _peaks(trace, hw)
    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.subplots()
    points = [(e["arithmetic_intensity_flop_per_byte"], e["attained_flop_per_s"], e["kind"]) for e in trace.steps
              if e.get("attained_flop_per_s")]
    ridge = peak / bandwidth
    xs = [p[0] for p in points] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    ax.plot([lo, ridge, hi], [lo * bandwidth, peak, peak], color=ROOF_COLOR, linewidth=2, label=name)
    ax.axvline(ridge, color=ROOF_COLOR, linestyle=":", linewidth=1)
    ax.annotate(f"ridge {ridge:.3g} FLOP/B", (ridge, peak), textcoords="offset points", xytext=(4, -14), fontsize=8)
    for kind, color, marker in (("decode", DECODE_COLOR, "o"), ("prefill", PREFILL_COLOR, "s")):
        pts = [(x, y) for x, y, k in points if k == kind]
        if pts:
            ax.scatter(*zip(*pts), color=color, marker=marker, s=30 if kind == "decode" else 60, zorder=3,
                       label=f"{kind} ({len(pts)} pass{'es' if len(pts) > 1 else ''})")
    for phase, r in trace.rooflines.items():
        ax.annotate(r["bound"], (r["arithmetic_intensity_flop_per_byte"], r["attained_flop_per_s"]),
                    textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attained FLOP/s")
    ax.set_title("Roofline")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def kv_cache(trace: Trace, path=None) -> Figure:
    """KV cache bytes after each pass against the cache length (positions filled)."""
    fig = Figure(figsize=(6.5, 3.5), layout="constrained")
    ax = fig.subplots()
    steps = trace.steps
    positions = [0] + [e["cache_length_after"] for e in steps]
    mib = [0.0] + [e["kv_bytes"] / 2**20 for e in steps]
    ax.plot(positions, mib, marker=".", color=DECODE_COLOR)
    if steps and steps[0]["kind"] == "prefill":
        ax.annotate(f"after prefill: {positions[1]} positions in one pass", (positions[1], mib[1]),
                    textcoords="offset points", xytext=(8, -4), fontsize=8)
    model = trace.first("model")
    if model:
        per_token = model["kv_bytes_per_token"]
        ax.set_title(f"KV cache: {per_token:,} bytes ({fmt_bytes(per_token)}) per token")
    ax.set_xlabel("position (tokens in the cache)")
    ax.set_ylabel("KV cache (MiB)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    return _save(fig, path)


def ttft_vs_prompt_length(result, path=None) -> Figure:
    """TTFT (ms) against prompt length, with the roofline floor when the sweep has one."""
    fig = _sweep_plot(result.prompt_lengths, result.ttft_ms, result.ttft_floor_ms, "prompt length (tokens)",
                      "TTFT (ms)", "TTFT vs prompt length (prefill)", PREFILL_COLOR, result)
    return _save(fig, path)


def tpot_vs_context_length(result, path=None) -> Figure:
    """TPOT (ms) against context length, with the roofline floor when the sweep has one."""
    fig = _sweep_plot(result.context_lengths, result.tpot_ms, result.tpot_floor_ms, "context length (tokens)",
                      "TPOT (ms)", "TPOT vs context length (decode)", DECODE_COLOR, result)
    return _save(fig, path)


def save_trace_plots(trace: Trace, out_dir, hw=None) -> list[Path]:
    """Write timeline.png, kv_cache.png and (with roofline data) roofline.png into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "timeline.png", out / "kv_cache.png"]
    timeline(trace, paths[0])
    kv_cache(trace, paths[1])
    if hw is not None or trace.rooflines:
        paths.append(out / "roofline.png")
        roofline(trace, hw, paths[-1])
    return paths


def save_sweep_plots(result, out_dir) -> list[Path]:
    """Write ttft_vs_prompt_length.png, tpot_vs_context_length.png, sweep.json and sweep.csv."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "ttft_vs_prompt_length.png", out / "tpot_vs_context_length.png"]
    ttft_vs_prompt_length(result, paths[0])
    tpot_vs_context_length(result, paths[1])
    return paths + [result.to_json(out / "sweep.json"), result.to_csv(out / "sweep.csv")]


def _sweep_plot(xs, ms, floors, xlabel, ylabel, title, color, result) -> Figure:
    fig = Figure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.subplots()
    ax.plot(xs, ms, marker="o", color=color, label=f"measured ({result.device}, {result.dtype})")
    if floors:
        ax.plot(xs, floors, linestyle="--", color=ROOF_COLOR, label=f"roofline floor ({result.hardware})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}{': ' + result.model if result.model else ''}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return fig


def _peaks(trace: Trace, hw) -> tuple[float, float, str]:
    if hw is not None:
        return hw.peak_flops, hw.mem_bandwidth, hw.name
    r = next(iter(trace.rooflines.values()), None)
    if r is None:
        raise ValueError("no hardware profile: pass hw= (minillm.hardware.get_hardware) or trace with one")
    return r["peak_flop_per_s"], r["peak_bytes_per_s"], r["hardware"]


def _save(fig: Figure, path) -> Figure:
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
