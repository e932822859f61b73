"""The notebook view of a :class:`~minillm.trace.Trace`: HTML and inline CSS.

In a notebook, end a cell with ``show(trace)`` (a :class:`TraceView`, which Jupyter displays
as this HTML); ``trace_html(trace)`` is the HTML as a string.

    header      TTFT, TPOT, end-to-end, throughput, tokens, the roofline verdict of each phase
    prompt      the prompt's tokens as chips (boundaries visible)
    steps       one row per pass: phase, the token it produced, a time bar coloured by phase,
                the top-k candidates as small probability bars, the KV cache filling up
                (prompt positions in the prefill colour, then one decode position per step)
    layers      (level "layers") per-layer time bars of the prefill and the first decode step,
                with the shapes written once per pass

Self-contained: inline ``style`` attributes only (no <style>, <script>, CDN or web font), so
it survives Jupyter's and GitHub's output sanitisers and looks the same offline. The block
sets its own white background and dark text, so it reads in dark notebook themes too.
Bars are ``<div>``s whose width is a percentage of a fixed track: proportional to the value.
Elements carry ``minillm-*`` class names (steps, bars, layers) for tests and custom CSS.
"""

from __future__ import annotations

import html

from ..trace import Trace
from ..units import fmt_bytes, fmt_ms, fmt_num
from .terminal import visible

PREFILL_COLOR, DECODE_COLOR = "#ff7f0e", "#1f77b4"  # matplotlib's tab:orange and tab:blue, as in plots.py
PHASE_COLORS = {"prefill": PREFILL_COLOR, "decode": DECODE_COLOR}
# Font stacks quote names with &quot;, which reads right inside single- and double-quoted attributes.
SANS = "system-ui,-apple-system,&quot;Segoe UI&quot;,Roboto,Arial,&quot;Liberation Sans&quot;,sans-serif"
MONO = "ui-monospace,SFMono-Regular,Menlo,Consolas,&quot;DejaVu Sans Mono&quot;,&quot;Liberation Mono&quot;,monospace"
MUTED, TRACK, BORDER = "#57606a", "#eaeef2", "#d0d7de"
TIME_TRACK_PX, KV_TRACK_PX, PROB_TRACK_PX = 160, 120, 60
LAYER_PASSES = 2  # like the terminal: the prefill and the first decode step


def trace_html(trace: Trace) -> str:
    """The whole view as one ``<div>``: header, prompt, steps, layers (each part when recorded)."""
    parts = [_header(trace), _prompt(trace), _steps(trace), _layers(trace), _legend()]
    style = (f"font-family:{SANS};font-size:13px;line-height:1.45;color:#1f2328;background:#ffffff;"
             f"padding:12px 14px;border:1px solid {BORDER};border-radius:8px;max-width:980px")
    return f"<div class='minillm-trace' style=\"{style}\">{''.join(p for p in parts if p)}</div>"


class TraceView:
    """A trace as a notebook shows it: Jupyter calls ``_repr_html_``; ``repr`` is the trace's own."""

    def __init__(self, trace: Trace):
        self.trace = trace

    def _repr_html_(self) -> str:
        return trace_html(self.trace)

    def __repr__(self) -> str:
        return repr(self.trace)


def show(trace: Trace) -> TraceView:
    """The trace for a notebook cell to display: end the cell with ``show(trace)``."""
    return TraceView(trace)


# -- the parts ---------------------------------------------------------------------------------


def _header(trace: Trace) -> str:
    title = (f"<div style='font-size:15px;font-weight:600'>Trace <span style='font-weight:400;color:{MUTED}'>"
             f"level {_esc(trace.level)} · {len(trace.events)} events</span></div>")
    chips = []
    m = trace.metrics
    if m is not None:
        chips += [("TTFT", fmt_ms(m["ttft_ms"]), PREFILL_COLOR),
                  ("TPOT", fmt_ms(m["tpot_ms"]) if m["tpot_ms"] is not None else "n/a", DECODE_COLOR),
                  ("end-to-end", fmt_ms(m["e2e_ms"]), MUTED),
                  ("output", f"{fmt_num(m['output_throughput_tok_s'])} tok/s", MUTED),
                  ("tokens", f"{m['n_prompt_tokens']} prompt + {m['n_output_tokens']} output", MUTED)]
    chips += [(f"{phase}", r["bound"], PHASE_COLORS[phase]) for phase, r in trace.rooflines.items()]
    pre = trace.prefill
    if pre is not None:
        chips.append(("prefill pass", f"{pre['n_tokens']} tokens, {fmt_num(pre['flops'] / 1e9)} GFLOP, "
                                      f"{fmt_bytes(pre['bytes'])} moved", PREFILL_COLOR))
    body = "".join(_chip(label, value, color) for label, value, color in chips)
    return title + (f"<div style='margin:6px 0 4px 0'>{body}</div>" if body else "")


def _prompt(trace: Trace) -> str:
    event = trace.first("tokenize")
    if event is None or not event.get("token_strings"):
        return ""
    pieces = "".join(
        f"<span class='minillm-prompt-token' style=\"font-family:{MONO};background:{('#fde7d4', '#dbe9f6')[i % 2]};"
        f"display:inline-block;padding:0 1px;margin:0 1px 0 0;border-radius:2px;white-space:pre\">"
        f"{_esc(visible(p))}</span>"  # inline-block: the line may break between tokens
        for i, p in enumerate(event["token_strings"]))
    return _section(f"Prompt: {event['n_tokens']} tokens", f"<div style='line-height:1.9'>{pieces}</div>")


def _steps(trace: Trace) -> str:
    passes = trace.steps
    if not passes:
        return ""
    max_ms = max(e["time_ms"] for e in passes) or 1.0
    max_len = max(e["cache_length_after"] for e in passes) or 1
    prompt_len = max(e["cache_length_after"] for e in passes if e["kind"] == "prefill") if trace.prefill else 0
    head = "".join(f"<th style='text-align:{align};padding:2px 8px;color:{MUTED};font-weight:600'>{h}</th>"
                   for h, align in (("#", "right"), ("phase", "left"), ("token", "left"), ("time", "left"),
                                    ("top-k (probability)", "left"), ("KV cache", "left")))
    rows = "".join(_step_row(n, e, max_ms, max_len, prompt_len) for n, e in enumerate(passes, start=1))
    table = (f"<table class='minillm-steps' style='border-collapse:collapse;font-size:12.5px'>"
             f"<tr style='border-bottom:1px solid {BORDER}'>{head}</tr>{rows}</table>")
    return _section("Steps: token #1 from the prefill, then one decode step each", table)


def _step_row(n: int, e: dict, max_ms: float, max_len: int, prompt_len: int) -> str:
    color = PHASE_COLORS[e["kind"]]
    time_bar = _bar(e["time_ms"] / max_ms, TIME_TRACK_PX, color, "minillm-time-bar", fmt_ms(e["time_ms"]))
    prompt_part = min(e["cache_length_after"], prompt_len) / max_len
    decode_part = (e["cache_length_after"] - min(e["cache_length_after"], prompt_len)) / max_len
    kv = (f"<div class='minillm-kv-bar' title='{e['cache_length_after']} positions' style='display:flex;"
          f"width:{KV_TRACK_PX}px;height:10px;background:{TRACK};border-radius:3px;overflow:hidden'>"
          f"<div style='width:{100 * prompt_part:.3f}%;background:{PREFILL_COLOR}'></div>"
          f"<div style='width:{100 * decode_part:.3f}%;background:{DECODE_COLOR}'></div></div>")
    cells = [
        (f"{n}", "right"),
        (f"<span style='color:{color};font-weight:600'>{e['kind']}</span>", "left"),
        (_token(e.get("next_token_id"), e.get("next_token_text")), "left"),
        (_with_label(time_bar, fmt_ms(e["time_ms"])), "left"),
        (_candidates(e), "left"),
        (_with_label(kv, f"{e['cache_length_after']} pos · {fmt_bytes(e['kv_bytes'])}"), "left"),
    ]
    tds = "".join(f"<td style='text-align:{align};padding:3px 8px;vertical-align:top'>{c}</td>" for c, align in cells)
    return f"<tr class='minillm-step' style='border-bottom:1px solid {TRACK}'>{tds}</tr>"


def _candidates(e: dict) -> str:
    chosen = e.get("next_token_id")
    lines = []
    for c in e.get("candidates", []):
        bar = _bar(c["prob"], PROB_TRACK_PX, "#6e7781", "minillm-topk-bar", f"p={c['prob']:.4f}", height=7)
        weight = "600" if c["token_id"] == chosen else "400"
        lines.append(f"<div style='display:flex;align-items:center;gap:6px;font-weight:{weight}'>"
                     f"<span style='width:110px;overflow:hidden;white-space:nowrap'>"
                     f"{_token(c['token_id'], c.get('text'))}</span>{bar}"
                     f"<span style='font-family:{MONO};font-size:11px'>{c['prob']:.2f}</span></div>")
    return "".join(lines) or f"<span style='color:{MUTED}'>not sampled</span>"


def _layers(trace: Trace) -> str:
    shown = sorted({e["step"] for e in trace.layers()})[:LAYER_PASSES]
    if not shown:
        return ""
    by_step = {step: trace.layers(step) for step in shown}
    shapes = "".join(_layer_shapes(by_step[step]) for step in shown)
    head = "<th style='text-align:right;padding:2px 8px'>layer</th>" + "".join(
        f"<th style='text-align:left;padding:2px 8px;color:{PHASE_COLORS[by_step[s][0]['phase']]}'>"
        f"step {s} ({by_step[s][0]['phase']})</th>" for s in shown)
    max_ms = {s: max((e["time_ms"] or 0) for e in by_step[s]) or 1.0 for s in shown}
    rows = []
    for i, first in enumerate(by_step[shown[0]]):
        cells = f"<td style='text-align:right;padding:1px 8px'>{first['layer']}</td>"
        for s in shown:
            e = by_step[s][i] if i < len(by_step[s]) else None
            ms = e["time_ms"] if e is not None else None
            cell = (_with_label(_bar(ms / max_ms[s], TIME_TRACK_PX, PHASE_COLORS[e["phase"]], "minillm-layer-bar",
                                     fmt_ms(ms)), fmt_ms(ms)) if ms is not None else "-")
            cells += f"<td style='padding:1px 8px'>{cell}</td>"
        rows.append(f"<tr class='minillm-layer'>{cells}</tr>")
    n_more = len({e["step"] for e in trace.layers()}) - len(shown)
    more = (f"<div style='color:{MUTED}'>{n_more} more passes have layer events: trace.layers(step)</div>"
            if n_more > 0 else "")
    table = (f"<table class='minillm-layers' style='border-collapse:collapse;font-size:12.5px'>"
             f"<tr style='border-bottom:1px solid {BORDER}'>{head}</tr>{''.join(rows)}</table>")
    return _section("Layers: time per layer (attention, MLP, K/V write); bars scaled per pass",
                    shapes + table + more)


def _layer_shapes(layers) -> str:
    """The shapes of one pass, written once (every layer of a pass has the same shapes)."""
    e = layers[0]
    text = (f"step {e['step']} ({e['phase']}): attention {_shape(e['attn_in_shape'])} → "
            f"{_shape(e['attn_out_shape'])} [B, T, d_model] · q {_shape(e['q_shape'])}, k, v "
            f"{_shape(e['k_shape'])} [B, heads, T, head_dim] · K/V cache {_shape(e['k_cache_shape'])} · "
            f"MLP {_shape(e['mlp_in_shape'])} → {_shape(e['mlp_out_shape'])}")
    return f"<div class='minillm-layer-shapes' style='font-family:{MONO};font-size:11.5px;color:{MUTED}'>{text}</div>"


def _legend() -> str:
    swatch = "display:inline-block;width:10px;height:10px;border-radius:2px;margin:0 4px 0 10px;background:"
    return (f"<div style='margin-top:8px;color:{MUTED};font-size:12px'>"
            f"<span style='{swatch}{PREFILL_COLOR}'></span>prefill (prompt positions in the KV cache)"
            f"<span style='{swatch}{DECODE_COLOR}'></span>decode (one position per step) · time: the forward "
            "pass · bars are proportional to the longest one shown</div>")


# -- pieces ------------------------------------------------------------------------------------


def _bar(fraction: float, track_px: int, color: str, cls: str, title: str, height: int = 10) -> str:
    """A bar ``fraction`` (0..1) of a ``track_px`` wide grey track."""
    pct = 100 * min(max(fraction, 0.0), 1.0)
    return (f"<div style='width:{track_px}px;height:{height}px;background:{TRACK};border-radius:3px;flex:none'>"
            f"<div class='{cls}' title='{_esc(title)}' style='width:{pct:.3f}%;height:100%;background:{color};"
            f"border-radius:3px'></div></div>")


def _with_label(bar: str, label: str) -> str:
    return (f"<div style='display:flex;align-items:center;gap:6px'>{bar}"
            f"<span style='font-family:{MONO};font-size:11.5px;white-space:nowrap'>{_esc(label)}</span></div>")


def _token(token_id, text) -> str:
    """A token as its quoted text with the id after it, or its id alone when there is no text."""
    if token_id is None:
        return f"<span style='color:{MUTED}'>-</span>"
    if text is None:
        return f"<code class='minillm-token-id' style='font-family:{MONO}'>id {token_id}</code>"
    return (f"<code class='minillm-token' style='font-family:{MONO};background:{TRACK};padding:0 3px;"
            f"border-radius:3px;white-space:pre'>{_esc(visible(text))}</code>"
            f"<span style='color:{MUTED};font-size:11px'> {token_id}</span>")


def _chip(label: str, value: str, color: str) -> str:
    return (f"<span class='minillm-chip' style='display:inline-block;margin:2px 6px 2px 0;padding:2px 8px;"
            f"border:1px solid {BORDER};border-left:4px solid {color};border-radius:4px'>"
            f"<span style='color:{MUTED}'>{_esc(label)}</span> <b>{_esc(value)}</b></span>")


def _section(title: str, body: str) -> str:
    return (f"<div style='margin-top:10px'><div style='font-weight:600;margin-bottom:4px'>{_esc(title)}</div>"
            f"{body}</div>")


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape) if shape else "-"


def _esc(text) -> str:
    return html.escape(str(text), quote=True)
