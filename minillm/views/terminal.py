"""Rendering a :class:`~minillm.trace.Trace`: rich panels and tables for the terminal
(the notebook view is :mod:`minillm.views.html`).

    prompt panel     the prompt's tokens, boundaries shown (colours, or "·" in plain text)
    prefill panel    tokens, positions, K/V written, cache, time, FLOPs, bytes, intensity
    layers table     (level "layers") per layer: shapes in and out, K/V cache, time
    steps table      one row per generated token: id, text, top-5, cache, KV bytes, ms, GB/s
    verify table     (speculative decoding) one block per verification pass: the drafted tokens,
                     which were kept, the model's own token (resampled or bonus), the KV cache
                     before / verified / after truncation; the request's acceptance rate
    summary panel    TTFT, TPOT, ITL, end-to-end, throughput, MBU
    roofline panel   the bound verdict of each phase, and why

Everything fits 80 columns. Timing values are printed at a fixed width, so that a
slower or faster run changes digits, never the layout. Library code returns rich
renderables; only :func:`print_trace` prints (to the console it is given).
"""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Column, Table
from rich.text import Text

from ..trace import Trace
from ..units import fmt_bytes, fmt_num

TOKEN_STYLES = ("on grey23", "on dark_blue")  # alternate backgrounds mark token boundaries
PLAIN_SEPARATOR = "·"
BUSY_CPU_SHARE = 0.75  # a pass that got less of its threads' CPU time than this shared the machine


def print_trace(trace: Trace, console: Console | None = None, prompt: bool = True) -> None:
    """Print every part of the trace: prompt, prefill, layers, steps, summary, roofline."""
    console = console or Console()
    parts = [prompt_panel(trace, plain=console.no_color or console.color_system is None)] if prompt else []
    parts += [prefill_panel(trace)]
    if trace.layers():
        parts += [layers_table(trace, step) for step in sorted({e["step"] for e in trace.layers()})[:2]]
    parts += [steps_panel(trace), verify_panel(trace), summary_panel(trace), roofline_panel(trace)]
    for part in parts:
        if part is not None:
            console.print(part)


# -- the parts -----------------------------------------------------------------------------


def prompt_panel(trace: Trace, plain: bool = False) -> Panel | None:
    """The prompt, each token in its own colour (or separated by "·" when ``plain``)."""
    event = trace.first("tokenize")
    if event is None:
        return None
    text = Text()
    pieces = event["token_strings"]
    for i, piece in enumerate(pieces):
        if plain and i and not pieces[i - 1].endswith("\n"):
            text.append(PLAIN_SEPARATOR, style="dim")
        text.append(visible(piece), style=None if plain else TOKEN_STYLES[i % 2])
        if piece.endswith("\n") and i < len(pieces) - 1:
            text.append("\n")  # show the line break too
    title = f"Prompt: {event['n_tokens']} tokens"
    return Panel(text, title=title, title_align="left", subtitle=f"tokenized in {event['time_ms']:7.2f} ms")


def prefill_panel(trace: Trace) -> Panel | None:
    """What the prefill pass did, in numbers."""
    e = trace.prefill
    if e is None:
        return None
    n_layers = _n_layers(trace)
    grid = _grid()
    grid.add_row("tokens", f"{e['n_tokens']} in one pass, positions {e['position_first']}..{e['position_last']}"
                 + (f" ({e['cached_tokens']} cached before)" if e["cached_tokens"] else ""))
    grid.add_row("K/V written", f"{_shape(e['kv_written_shape'])} per layer, K and V, x {n_layers} layers "
                 f"= {fmt_bytes(e['kv_written_bytes'])}")
    grid.add_row("cache", f"{e['cache_length_before']} -> {e['cache_length_after']} positions, "
                 f"{fmt_bytes(e['kv_bytes'])}")
    grid.add_row("work", f"{fmt_num(e['flops'] / 1e9)} GFLOP, {fmt_bytes(e['bytes'])} moved "
                 f"(weights {fmt_bytes(e['weights_bytes'])}), "
                 f"{fmt_num(e['arithmetic_intensity_flop_per_byte'])} FLOP/byte")
    grid.add_row("time", f"{e['time_ms']:9.1f} ms forward pass ({e['attn_impl']} attention)")
    grid.add_row("attained", f"{_rate(e['attained_flop_per_s'], 1e9):>9} GFLOP/s "
                 f"{_rate(e['attained_bytes_per_s'], 1e9):>9} GB/s")
    if "next_token_id" in e:
        grid.add_row("first token", _choice(e))
    warm = "after a warm-up pass" if trace.first("warmup") else "no warm-up: includes one-time setup"
    return Panel(grid, title="Prefill", title_align="left", subtitle=warm)


def layers_table(trace: Trace, step: int = 0) -> Group:
    """Per-layer times of one pass (level "layers"), with the shapes written once above them.

    Every layer of a pass has the same shapes, so they are printed once; then one compact row
    per layer (its time and a bar), so 80 columns never wrap a row. A layer whose shapes
    differ from the first one's gets them on its row.
    """
    layers = trace.layers(step)
    phase = layers[0]["phase"] if layers else "?"
    first = layers[0] if layers else {}
    shapes = _grid()
    shapes.add_row("attention", f"{_shape(first.get('attn_in_shape'))} -> {_shape(first.get('attn_out_shape'))}"
                   "  [B, T, d_model]")
    shapes.add_row("q | k, v", f"{_shape(first.get('q_shape'))} | {_shape(first.get('k_shape'))}"
                   "  [B, heads, T, head_dim]")
    shapes.add_row("K/V cache", f"{_shape(first.get('k_cache_shape'))}  [B, kv_heads, S, head_dim]")
    shapes.add_row("MLP", f"{_shape(first.get('mlp_in_shape'))} -> {_shape(first.get('mlp_out_shape'))}")
    max_ms = max((e["time_ms"] or 0 for e in layers), default=0) or 1.0
    table = Table(Column("layer", justify="right"), Column("ms", justify="right", width=8, no_wrap=True),
                  Column("", no_wrap=True), box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False)
    for e in layers:
        bar = "█" * round(LAYER_BAR_WIDTH * (e["time_ms"] or 0) / max_ms)
        differs = [k for k in _LAYER_SHAPES if e.get(k) != first.get(k)]
        note = "  " + ", ".join(f"{k.removesuffix('_shape')} {_shape(e[k])}" for k in differs) if differs else ""
        table.add_row(str(e["layer"]), _num(e["time_ms"], ".2f"), bar + note)
    pass_event = next((e for e in trace.steps if e["step"] == step), None)
    layer_ms = sum(e["time_ms"] or 0 for e in layers)
    caption = (Text(f"layers: {layer_ms:.1f} ms of the {pass_event['time_ms']:.1f} ms pass; the rest is the "
                    "embedding, the final norm and the LM head", style="dim") if pass_event is not None else "")
    title = Text(f"Layers of step {step} ({phase}): {len(layers)} layers, the same shapes in each", style="bold")
    return Group(title, shapes, table, caption)


LAYER_BAR_WIDTH = 40  # characters for the slowest layer of the pass
_LAYER_SHAPES = ("attn_in_shape", "q_shape", "k_shape", "k_cache_shape", "mlp_out_shape")


STEP_HEADER = f"{'#':>4} {'id':>6}  {'token':<14} {'cache':>6} {'KV':>10} {'ms':>8} {'GB/s':>7}"


def steps_panel(trace: Trace) -> Panel | None:
    """One block per generated token: #1 from the prefill's logits, the others from one decode step each.

        #     id  token           cache         KV       ms    GB/s
        1     49  'A'                39    1.7 MiB    312.4    1.73
              top-5: 'A' 0.47  'The' 0.25  'In' 0.12  'K' 0.07  'It' 0.01

    cache: positions after the pass; KV: cache bytes; ms: the forward pass; GB/s: bytes moved / ms.
    """
    rows = [e for e in trace.steps if "next_token_id" in e]
    if not rows:
        return None
    lines = [Text(STEP_HEADER, style="bold")]
    for n, e in enumerate(rows, start=1):
        lines.append(Text(
            f"{n:>4} {e['next_token_id']:>6}  {_token(e.get('next_token_text')):<14} "
            f"{e['cache_length_after']:>6} {fmt_bytes(e['kv_bytes']):>10} "
            f"{_num(e['time_ms'], '.1f'):>8} {_rate(e['attained_bytes_per_s'], 1e9):>7}"
        ))
        lines += [Text(" " * 12 + line, style="dim") for line in _packed("top-5: ", _candidate_items(e), 64)]
    return Panel(Group(*lines), title="Steps: #1 from the prefill, then one decode step each",
                 title_align="left", subtitle="ms: forward pass; GB/s: bytes moved per second")


VERIFY_HEADER = f"{'#':>4} {'pos':>6} {'kept':>5}  {'+ model token':<14} {'how':<9} {'cache':>15} {'ms':>8}"
REJECTED = "✗"  # marks a draft the model did not keep (also readable without colour)


def verify_panel(trace: Trace) -> Panel | None:
    """Speculative decoding: one block per verification pass (its "verify" event).

           #    pos  kept  + model token  how                 cache       ms
           1     39   3/5  ' the'         resampled   39->45->43      61.2
                 drafted: ' over'  ' the'  ' lazy'  ✗' cat'  ✗'.'

    pos: position of the pass's first token (the last one emitted); kept: drafts accepted of those
    proposed; + model token: the token the model adds (resampled at the first rejection, the bonus
    when all were kept, plain "decode" when nothing was proposed); cache: positions before the
    pass -> after it wrote every row -> after truncating the rejected ones; ms: the pass.
    The subtitle: the request's acceptance rate and mean acceptance length (the "speculative" event).
    """
    passes = trace.of("verify")
    if not passes:
        return None
    lines = [Text(VERIFY_HEADER, style="bold")]
    for n, e in enumerate(passes, start=1):
        cache = f"{e['cache_length_before']}->{e['cache_length_verified']}->{e['cache_length_after']}"
        lines.append(Text(f"{n:>4} {e['position']:>6} {e['accepted']:>2}/{e['proposed']:<2}  "
                          f"{_token(e.get('token_text'), e['token_id']):<14} {e['how']:<9} {cache:>15} "
                          f"{_num(e['time_ms'], '.1f'):>8}"))
        texts = e.get("drafted_text") or [None] * len(e["drafted"])
        items = [("" if i < e["accepted"] else REJECTED) + _token(text, token_id)
                 for i, (text, token_id) in enumerate(zip(texts, e["drafted"]))]
        if items:
            lines += [Text(" " * 12 + line, style="dim") for line in _packed("drafted: ", items, 66)]
    stats = trace.first("speculative")
    subtitle = (f"acceptance {100 * stats['acceptance_rate']:.1f}% ({stats['num_accepted_tokens']}/"
                f"{stats['num_draft_tokens']}), mean acceptance length {stats['mean_acceptance_length']:.2f}"
                if stats is not None else None)
    return Panel(Group(*lines), title=f"Verification passes: {len(passes)} (speculative decoding)",
                 title_align="left", subtitle=subtitle)


def summary_panel(trace: Trace) -> Panel | None:
    """TTFT, TPOT, ITL, end-to-end, throughput and MBU of the request."""
    m = trace.metrics
    if m is None:
        return None
    grid = _grid()
    n_decode = m["n_output_tokens"] - 1
    grid.add_row("TTFT", f"{m['ttft_ms']:9.1f} ms  request start -> first token")
    if m["tpot_ms"] is not None:
        grid.add_row("TPOT", f"{m['tpot_ms']:9.1f} ms  mean gap over {n_decode} decode steps")
        grid.add_row("ITL", f"p50 {m['itl_p50_ms']:7.1f} ms  p90 {m['itl_p90_ms']:7.1f} ms  "
                     f"p99 {m['itl_p99_ms']:7.1f} ms")
    else:
        grid.add_row("TPOT", "n/a (one output token)")
    grid.add_row("end-to-end", f"{m['e2e_ms']:9.1f} ms  {m['n_prompt_tokens']} prompt + "
                 f"{m['n_output_tokens']} output tokens, stop: {m['finish_reason']}")
    grid.add_row("throughput", f"{m['output_throughput_tok_s']:9.1f} tok/s output  "
                 f"{m['prefill_throughput_tok_s']:9.1f} tok/s prefill")
    mbu = m.get("mbu")
    grid.add_row("MBU", f"{100 * mbu:9.1f} %  of peak bandwidth, per decode step" if mbu is not None
                 else "n/a (needs a hardware profile and a decode step)")
    detok = trace.first("detokenize")
    if detok is not None:
        grid.add_row("detokenize", f"{detok['time_ms']:9.2f} ms  for {detok['n_tokens']} tokens")
    model = trace.first("model")
    if model is not None and model.get("decode_path"):
        grid.add_row("path", f"{model['decode_path']}  decode path (minillm/fast/choose.py)")
    collectives = trace.of("all_reduce") + trace.of("all_gather")
    if collectives:  # tensor parallel (minillm/distributed): the time this rank spent communicating
        comm_ms = sum(e["time_ms"] for e in collectives)
        pass_ms = sum(e["time_ms"] for e in trace.steps)
        grid.add_row("all-reduce", f"{comm_ms:9.1f} ms  in {len(trace.of('all_reduce'))} all-reduces and "
                     f"{len(trace.of('all_gather'))} all-gathers ({fmt_bytes(sum(e['bytes'] for e in collectives))}), "
                     f"{100 * comm_ms / pass_ms:.0f}% of the passes' time, over {collectives[0]['world_size']} "
                     f"ranks ({collectives[0]['backend']})")
    return Panel(grid, title="Summary", title_align="left")


def roofline_panel(trace: Trace) -> Panel | None:
    """The bound verdict of each phase against the hardware, with the reason."""
    verdicts = trace.rooflines
    if not verdicts:
        return None
    any_event = next(iter(verdicts.values()))
    grid = _grid()
    # the peaks go in a row, not the title: rich cuts a long title mid-number at 80 columns
    grid.add_row("peaks", f"{fmt_num(any_event['peak_flop_per_s'] / 1e9)} GFLOP/s, "
                 f"{fmt_num(any_event['peak_bytes_per_s'] / 1e9)} GB/s, ridge "
                 f"{fmt_num(any_event['ridge_point_flop_per_byte'])} FLOP/byte")
    for phase, r in verdicts.items():
        grid.add_row(phase, Text(r["bound"], style="bold"))
        steps = f"{r['n_passes']} step{'s' if r['n_passes'] != 1 else ''}, " if phase == "decode" else ""
        flops, bw = r["attained_flop_per_s"], r["attained_bytes_per_s"]
        grid.add_row("", f"{steps}{fmt_num(r['arithmetic_intensity_flop_per_byte'])} FLOP/byte, "
                     f"{fmt_num(flops / 1e9)} GFLOP/s ({_pct(flops, r['peak_flop_per_s'])} of peak), "
                     f"{fmt_num(bw / 1e9)} GB/s ({_pct(bw, r['peak_bytes_per_s'])} of peak)")
        grid.add_row("", Text(r["explanation"], style="dim"))
        expected = {"prefill": "compute-bound", "decode": "memory-bound"}[phase]
        if r["bound"] != expected:
            grid.add_row("", Text(_why_not(phase, r, expected), style="italic"))
    return Panel(grid, title=f"Roofline: {any_event['hardware']}", title_align="left")


def _why_not(phase: str, r: dict, expected: str) -> str:
    """The textbook verdict of a phase, and why this run differs from it."""
    ai, ridge = r["arithmetic_intensity_flop_per_byte"], r["ridge_point_flop_per_byte"]
    if r["bound"] != "overhead-bound":
        side = "above" if ai >= ridge else "below"
        return (f"Textbook {phase} is {expected}. Not here: its intensity {fmt_num(ai)} FLOP/byte is {side} "
                f"this machine's ridge point {fmt_num(ridge)} FLOP/byte.")
    load, cpus, share = r.get("load_average_1m"), r.get("cpu_count"), r.get("cpu_share")
    if share is not None and share < BUSY_CPU_SHARE:
        why = (f"other processes were running: this one got {100 * share:.0f}% of the CPU time its "
               f"{r['torch_threads']} threads could use (load average {load:.1f} on {cpus} CPUs)")
    elif load is not None and cpus and load > cpus:
        why = f"this machine was busy (load average {load:.1f} on {cpus} CPUs): other processes took its CPU time"
    elif phase == "prefill":
        why = "a short prompt gives each kernel too little work to hide per-op overhead"
    else:
        why = ("a small model spends much of each step on per-op dispatch, and matrix-vector "
               "products rarely stream at full copy bandwidth")
    return f"Textbook {phase} is {expected}. Not here, {1 / r['roofline_fraction']:.1f}x its floor: {why}."


# -- formatting ---------------------------------------------------------------------------------


def visible(text: str) -> str:
    """Control characters as escapes (``\\n``, ``\\t``, ``\\x1b``), everything else as is."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _quoted(text: str, limit: int = 12) -> str:
    text = visible(text)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return f"'{text}'"


def _token(text: str | None, token_id: int | None = None) -> str:
    """A token's quoted text; without a tokenizer, its id (``id 17``) or "-" where the id is shown already."""
    if text is not None:
        return _quoted(text)
    return f"id {token_id}" if token_id is not None else "-"


def _candidate_items(e: dict) -> list[str]:
    return [f"{_token(c.get('text'), c['token_id'])} {c['prob']:.2f}" for c in e.get("candidates", [])]


def _packed(prefix: str, items: list[str], width: int) -> list[str]:
    """Items joined by two spaces into lines of at most ``width`` characters, never split."""
    lines, line = [], prefix
    for item in items:
        if line.strip() and len(line) + 2 + len(item) > width and line != prefix:
            lines.append(line)
            line = " " * len(prefix) + item
        else:
            line += ("  " if line != prefix else "") + item
    return lines + [line]


def _choice(e: dict) -> str:
    how = e["sampling"]
    if how["method"] == "greedy":
        method = "greedy (the most likely)"
    else:
        method = (f"sampled at temperature {how['temperature']:g}, top-k {how['top_k'] or 'off'}, "
                  f"top-p {how['top_p']:g}; rank {e['next_token_rank']} of the model's distribution")
    text = e.get("next_token_text")
    token = f"{_quoted(text)} (id {e['next_token_id']}, " if text is not None else f"id {e['next_token_id']} ("
    return (f"{token}p={e['next_token_prob']:.2f}), "
            f"{method}")


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape) if shape else "-"


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rate(value, unit: float) -> str:
    """A rate in units of ``unit`` (1e9 for G) with 2 decimals; '-' when unknown."""
    return "-" if value is None else f"{value / unit:.2f}"


def _pct(value: float, peak: float) -> str:
    return f"{100 * value / peak:.0f}%" if peak else "n/a"


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    return grid


def _n_layers(trace: Trace) -> int:
    model = trace.first("model")
    return model["n_layers"] if model else 0


__all__ = [
    "fmt_bytes", "layers_table", "prefill_panel", "print_trace", "prompt_panel", "roofline_panel", "steps_panel",
    "summary_panel", "verify_panel", "visible",
]
