"""A run's numbers as a rich table, markdown (BENCHMARKS.md), JSON and a plot."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from pathlib import Path

from .results import BenchResult, Measurement, MemoryReport
from .targets import check_targets

COLUMNS = ("phase", "length", "batch", "engine", "TTFT/TPOT ms", "tok/s", "x transformers",
           "floor ms", "% of floor", "bound", "same tokens")


def table_rows(result: BenchResult) -> list[list[str]]:
    """One row of strings per measurement, in COLUMNS order (for the rich table and markdown)."""
    rows = []
    for m in result.measurements:
        spread = f" ({min(m.times_ms):.1f}-{max(m.times_ms):.1f})" if len(m.times_ms) > 1 else ""
        rows.append([
            m.phase, str(m.length), str(m.batch_size), m.engine,
            f"{m.time_ms:.1f}{spread}", f"{m.tokens_per_s:,.1f}",
            "-" if m.vs_reference is None else f"{m.vs_reference:.2f}x",
            f"{m.floor_ms:.1f}", f"{100 * m.floor_fraction:.0f}%", m.bound,
            {None: "-", True: "yes", False: "no"}[m.same_tokens],
        ])
    return rows


def machine_line(result: BenchResult) -> str:
    hw = result.hardware
    return (f"{result.model}, {result.dtype} on {hw.name}, {result.threads} threads; "
            f"peaks {hw.peak_flops / 1e9:,.1f} GFLOP/s, {hw.mem_bandwidth / 1e9:,.1f} GB/s; "
            f"weights {result.weights_bytes / 1e6:,.0f} MB; {result.repeats} repeat{'s' if result.repeats != 1 else ''}, medians; "
            f"{', '.join(f'{k} {v}' for k, v in result.versions.items())}")


def rich_table(result: BenchResult):
    """The measurements as a ``rich.table.Table`` (the CLI prints it)."""
    from rich.table import Table

    table = Table(title=machine_line(result), title_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("phase", "engine", "bound") else "right")
    ms = result.measurements
    for i, (m, row) in enumerate(zip(ms, table_rows(result))):
        last_of_case = i + 1 == len(ms) or _case(ms[i + 1]) != _case(m)
        table.add_row(*row, end_section=last_of_case)
    return table


def _case(m: Measurement) -> tuple:
    return m.phase, m.length, m.batch_size


def targets_rich_table(result: BenchResult):
    """The targets as a ``rich.table.Table``; None when this run measured none of them."""
    from rich.table import Table

    if not check_targets(result):
        return None
    table = Table(title="targets (batch 1, minillm-sdpa unless named)", title_justify="left")
    for col in ("target", "measured", "needed", "met", "detail"):
        table.add_column(col)
    for t in check_targets(result):
        measured = "-" if t.measured is None else f"{t.measured:.2f}"
        met = {None: "not measured", True: "[green]yes[/green]", False: "[red]no[/red]"}[t.met]
        table.add_row(t.name, measured, f">= {t.target:.2f}" if "memory" not in t.name else f"<= {t.target:.0f}",
                      met, t.detail)
    return table


def to_markdown(result: BenchResult) -> str:
    """The measurements, targets and memory as markdown tables (for BENCHMARKS.md)."""
    lines = [f"Measured: {machine_line(result)}; {result.wall_s:.0f} s.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    lines += ["", "| target | measured | needed | met | detail |", "|---|---|---|---|---|"]
    for t in check_targets(result):
        measured = "-" if t.measured is None else f"{t.measured:.2f}"
        needed = f"<= {t.target:.0f}" if "memory" in t.name else f">= {t.target:.2f}"
        met = {None: "not measured", True: "yes", False: "**no**"}[t.met]
        lines.append(f"| {t.name} | {measured} | {needed} | {met} | {t.detail} |")
    if result.memory is not None:
        lines += ["", memory_line(result.memory)]
    lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def to_json(result: BenchResult, path) -> Path:
    """Write every number and the targets checked against them as JSON (``minillm bench --json``)."""
    d = result.to_dict()
    d["targets"] = [asdict(t) for t in check_targets(result)]
    path = Path(path)
    path.write_text(json.dumps(d, indent=2))
    return path


def memory_line(mem: MemoryReport) -> str:
    mb = lambda n: f"{n / 1e6:,.0f} MB"  # noqa: E731
    line = (f"Memory, generating {mem.n_tokens} tokens (fresh process): peak RSS {mb(mem.generate_peak_bytes)} "
            f"while generating, {mb(mem.process_peak_bytes)} over the whole process (loading included); "
            f"budget {mb(mem.budget_bytes)} = weights {mb(mem.weights_bytes)} + KV cache {mb(mem.kv_cache_bytes)} "
            f"+ 300 MB; Python + torch alone: {mb(mem.import_rss_bytes)}.")
    if mem.device_peak_bytes is not None:
        line += f" GPU peak allocated: {mb(mem.device_peak_bytes)}."
    return line


def plot(result: BenchResult, path) -> Path:
    """tok/s against length per engine (prefill left, decode right), the floors dashed; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, phase in zip(axes, ("prefill", "decode")):
        ms = [m for m in result.measurements if m.phase == phase]
        for batch in sorted({m.batch_size for m in ms}):
            style = "-" if batch == 1 else "--"
            for i, engine in enumerate(result.engines()):
                pts = sorted((m.length, m.tokens_per_s) for m in ms if m.engine == engine and m.batch_size == batch)
                if pts:
                    label = engine if batch == 1 else f"{engine}, batch {batch}"
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=label)
            floor = sorted({(m.length, m.batch_size * (m.length if phase == "prefill" else 1) / m.floor_ms * 1e3)
                            for m in ms if m.batch_size == batch})
            if floor:
                ax.plot(*zip(*floor), style, marker="_", markersize=14, color="black", linewidth=2.5, alpha=0.5,
                        label=f"floor (roofline){'' if batch == 1 else f', batch {batch}'}")
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens" if phase == "prefill" else "context tokens",
               ylabel="tok/s", title=f"{phase}: " + ("prompt tokens / TTFT" if phase == "prefill" else "batch / TPOT"))
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(machine_line(result), 150), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
