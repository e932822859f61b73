"""The serving engine in the terminal: rich tables of its steps, its KV pool and its requests.

    steps_table(engine.steps)       one row per step: the batch ("0:P32 1:D1"), tokens, blocks
    pool_panel(engine.cache)        the pool as a strip of cells (used / shared / cached / free)
                                    and each request's block table
    requests_table(engine.requests) one row per request: tokens, queue, TTFT, TPOT, e2e, finish

Library code returns rich renderables; the CLI or a notebook prints them (rich tables show
in Jupyter as they are; ``PagedKVCache`` also has its own ``_repr_html_``).
"""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Column, Table
from rich.text import Text

from ..serving.run_metrics import request_metrics
from ..serving.step_trace import batch_label
from ..units import fmt_bytes

# One cell per block. The glyphs differ too, so the strip reads without colour.
CELLS = {
    "used": ("█", "green"),      # held by one request
    "shared": ("▓", "yellow"),   # held by several (a prefix-cache hit)
    "cached": ("▒", "blue"),     # free, but its hash is kept: a later request can still hit it
    "free": ("·", "grey50"),     # free and empty
}
CELLS_PER_LINE = 64


def steps_table(steps, max_rows: int = 40) -> Table:
    """One row per engine step; past ``max_rows``, the first and last steps with a gap row.

        step    ms  batch              P   D  used free cached  preempted  finished
           0  12.3  0:P32 1:P7 2:P4   43   0     5    1      3
           1   3.1  0:D1 1:D1          0   2     4    2      4  2

    P, D: prefill and decode tokens of the step; used / free / cached: the pool's blocks
    after it (a cached block with no owner counts as free too).
    """
    steps = list(steps)
    n_prefill = sum(s.num_prefill_tokens for s in steps)
    n_decode = sum(s.num_decode_tokens for s in steps)
    total_ms = sum(s.time_ms for s in steps)
    table = Table(
        Column("step", justify="right"), Column("ms", justify="right", no_wrap=True),
        Column("batch", overflow="fold", ratio=1), Column("P", justify="right"), Column("D", justify="right"),
        Column("used", justify="right"), Column("free", justify="right"), Column("cached", justify="right"),
        Column("preempted"), Column("finished"),
        title=f"Engine steps: {len(steps)} steps, {n_prefill} prefill + {n_decode} decode tokens, "
              f"{total_ms:.1f} ms",
        caption="batch: request:P(refill)/D(ecode) tokens; P, D: tokens of the step; "
                "used/free/cached: blocks after it",
        box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False,
    )
    for step in _shown(steps, max_rows):
        if step is None:
            table.add_row("…", "", Text(f"{len(steps) - max_rows} steps not shown", style="dim"))
            continue
        table.add_row(
            str(step.step), f"{step.time_ms:.1f}", batch_label(step) or Text("(empty)", style="dim"),
            str(step.num_prefill_tokens), str(step.num_decode_tokens), str(step.num_blocks_used),
            str(step.num_blocks_free), str(step.num_blocks_cached),
            Text(" ".join(step.preempted), style="red"), " ".join(step.finished),
        )
    return table


def _shown(items: list, max_rows: int) -> list:
    """All items, or the first and last halves of ``max_rows`` with None marking the gap."""
    if len(items) <= max_rows:
        return items
    head = max_rows - max_rows // 2
    return items[:head] + [None] + items[len(items) - max_rows // 2:]


def pool_panel(cache, max_blocks: int = 1024) -> Panel:
    """The paged KV pool: a cell per block (legend below) and every request's block table.

        ████████▒▒▒·······  used 8, cached 3, free 10 of 18 blocks

    ``cache``: a :class:`~minillm.serving.paged_cache.PagedKVCache` (``engine.cache``).
    """
    a = cache.allocator
    strip = Text()
    for i, block in enumerate(a.blocks[:max_blocks]):
        if i and i % CELLS_PER_LINE == 0:
            strip.append("\n")
        glyph, style = CELLS[_block_state(block)]
        strip.append(glyph, style=style)
    if a.num_blocks > max_blocks:
        strip.append(f" … (+{a.num_blocks - max_blocks} blocks)", style="dim")
    legend = Text()
    for state, (glyph, style) in CELLS.items():
        legend.append(f"{glyph} {state}  ", style=style)
    tables = Table(Column("request"), Column("block table", overflow="fold"), box=box.SIMPLE_HEAD,
                   show_edge=False, padding=(0, 1))
    for request_id, table in a.block_tables.items():
        tables.add_row(request_id, str(table))
    parts = [strip, legend] + ([tables] if a.block_tables else [Text("no request holds blocks", style="dim")])
    title = (f"KV pool: {a.num_blocks} blocks × {cache.block_size} positions, "
             f"{fmt_bytes(cache.bytes_per_block)} each")
    subtitle = (f"used {a.num_used_blocks}, free {a.num_free_blocks}, cached {a.num_cached_blocks}  "
                f"({fmt_bytes(cache.bytes_used)} of {fmt_bytes(cache.bytes_capacity)})")
    return Panel(Group(*parts), title=title, title_align="left", subtitle=subtitle)


def _block_state(block) -> str:
    if block.ref_count > 1:
        return "shared"
    if block.ref_count == 1:
        return "used"
    return "cached" if block.block_hash is not None else "free"


def requests_table(requests, max_rows: int = 40) -> Table:
    """One row per request: tokens, prefix-cache hits, latencies from arrival, preemptions, finish.

    queue: arrival to first scheduled; TTFT, TPOT, e2e as :mod:`minillm.serving.run_metrics`
    (from arrival). "-" where a request has no value yet (still waiting, one token: no TPOT).
    ``requests``: ``engine.requests`` (a dict) or a list of requests.
    """
    requests = list(requests.values()) if isinstance(requests, dict) else list(requests)
    n_done = sum(1 for r in requests if r.finish_reason is not None)
    table = Table(
        Column("request"), Column("prompt", justify="right"), Column("output", justify="right"),
        Column("cached", justify="right"), Column("queue ms", justify="right"),
        Column("TTFT ms", justify="right"), Column("TPOT ms", justify="right"), Column("e2e ms", justify="right"),
        Column("preempt", justify="right"), Column("finish"),
        title=f"Requests: {len(requests)}, {n_done} finished",
        caption="cached: prompt tokens from the prefix cache; latencies from arrival",
        box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False,
    )
    for r in _shown(requests, max_rows):
        if r is None:
            table.add_row("…", Text(f"{len(requests) - max_rows} requests not shown", style="dim"))
            continue
        queue, ttft, tpot, e2e = _latencies(r)
        table.add_row(
            r.request_id, str(r.num_prompt_tokens), str(len(r.output_ids)), str(r.num_cached_tokens),
            queue, ttft, tpot, e2e, Text(str(r.num_preemptions), style="red" if r.num_preemptions else ""),
            r.finish_reason or Text(r.status, style="dim"),
        )
    return table


def _latencies(r) -> tuple[str, str, str, str]:
    """queue, TTFT, TPOT, e2e (ms) as cells; "-" for what the request does not have yet."""
    queue = "-" if r.first_scheduled_s is None else f"{(r.first_scheduled_s - r.arrival_s) * 1e3:.1f}"
    if not r.token_times_s or r.first_scheduled_s is None:
        return queue, "-", "-", "-"
    try:
        m = request_metrics(r)
    except ValueError:  # timestamps out of order (e.g. an arrival_s given in the future): no latencies
        return queue, "-", "-", "-"
    tpot = "-" if m.tpot_ms is None else f"{m.tpot_ms:.1f}"
    e2e = f"{m.e2e_ms:.1f}" if r.finish_s is not None else "-"
    return queue, f"{m.ttft_ms:.1f}", tpot, e2e


__all__ = ["pool_panel", "requests_table", "steps_table"]
