"""Rendering a trace: the CLI's --trace on the real default model (golden text, timings
masked), 80-column layout, the verdict explanations, and the plots."""

import json
import os
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from minillm import SamplingParams, generate, load_model
from minillm.views import plots
from minillm.hardware import PROFILES
from minillm.views.terminal import print_trace, visible
from minillm.sweep import sweep
from minillm.trace import Trace

from tiny_models import CONFIGS, build_hf, save_hf

GOLDEN = Path(__file__).parents[1] / "golden" / "generate_trace.txt"
PROMPT = "Explain the KV cache in one sentence."
TIMING_UNITS = r"(?:ms|GB/s|GFLOP/s|tok/s|%)"
KV_BYTES = r"[\d.]+ (?:B|KiB|MiB|GiB)"


def mask_timings(text: str) -> str:
    """Replace what depends on measured time, keeping the layout (widths) intact.

    - the roofline panel: its verdicts and its title (this machine's calibrated peaks)
      depend on measured times;
    - every number followed by a timing unit (ms, GB/s, GFLOP/s, tok/s, % for MBU);
    - the ms and GB/s columns of the step rows.
    Token ids, texts, probabilities, cache lengths, KV bytes, FLOPs and bytes stay.
    """
    text = re.sub(r"╭─ Roofline.*?╰─+╯", "<roofline panel: verdicts from measured times>", text, flags=re.S)
    text = re.sub(rf" *\d[\d.]*(?= {TIMING_UNITS})", lambda m: "#".rjust(len(m[0])), text)
    row = rf"(?m)^(│ +\d+ +\d+  '.*' +\d+ +{KV_BYTES})( +[\d.]+)( +[\d.]+)"
    return re.sub(row, lambda m: m[1] + "#".rjust(len(m[2])) + "#".rjust(len(m[3])), text)


def minillm(*args, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE")}
    env.update(COLUMNS="80", LINES="50")
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, env=env,
                          timeout=600, **kwargs)


@pytest.fixture(scope="module")
def cli_run(smollm2_dir, tmp_path_factory):
    """One real traced run of the default model, shared by the tests below."""
    out = tmp_path_factory.mktemp("trace")
    r = minillm("generate", PROMPT, "--trace", "--max-new-tokens", "8", "--trace-out", str(out / "trace.jsonl"),
                "--plots", str(out / "plots"))
    assert r.returncode == 0, r.stderr
    return r, out


def _panels(stderr: str) -> str:
    """The trace as rendered on stderr, less the "wrote PATH" lines (temporary paths)."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("wrote "))


@pytest.mark.cli
def test_cli_trace_matches_the_golden_text(cli_run):
    r, _ = cli_run
    got = mask_timings(_panels(r.stderr))
    if os.environ.get("MINILLM_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "rendering changed; rerun with MINILLM_UPDATE_GOLDEN=1 if intended"


@pytest.mark.cli
def test_cli_trace_shows_every_phase_within_80_columns(cli_run):
    out = _panels(cli_run[0].stderr)
    for title in ("Prompt: ", "Prefill", "Steps: ", "Summary", "Roofline: "):
        assert f"╭─ {title}" in out
    assert len(re.findall(r"(?m)^│ +\d+ +\d+  '", out)) == 8  # one row per generated token
    for verdict in re.findall(r"(?m)^│ (prefill|decode) +(\S+)", out):
        assert verdict[1] in ("compute-bound", "memory-bound", "overhead-bound")
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "\x1b[" not in out  # plain text when not a terminal


@pytest.mark.cli
def test_cli_trace_out_and_plots(cli_run):
    run, out = cli_run
    records = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("prefill") == 1 and kinds.count("decode") == 7
    assert {"tokenize", "metrics", "detokenize", "roofline", "model", "warmup"} <= set(kinds)
    assert run.stdout == next(e for e in records if e["kind"] == "detokenize")["text"] + "\n"  # just the answer
    assert f"wrote {out / 'trace.jsonl'}\n" in run.stderr
    assert f"wrote {out / 'plots' / 'roofline.png'}\n" in run.stderr
    metrics = next(r for r in records if r["kind"] == "metrics")
    prefill = next(r for r in records if r["kind"] == "prefill")
    assert metrics["ttft_ms"] == pytest.approx(prefill["end_ms"], abs=1e-6)
    for name in ("timeline.png", "kv_cache.png", "roofline.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.cli
def test_the_same_weights_read_the_same_in_info_whatif_and_the_trace(cli_run, smollm2_dir):
    info = minillm("info")
    whatif = minillm("whatif", "--config", str(smollm2_dir), "--dtype", "float32", "--hardware", "h100")
    assert info.returncode == whatif.returncode == 0, info.stderr + whatif.stderr
    # 538,060,032 bytes of float32 weights / 2**20 = 513.13 MiB, in every command
    assert "538,060,032 (513.1 MiB)" in info.stdout and "538,060,032 (513.1 MiB)" in whatif.stdout
    trace_text = cli_run[0].stdout + cli_run[0].stderr  # the panels may go to either stream
    assert "(weights 513.1 MiB)" in trace_text
    for out in (info.stdout, whatif.stdout, trace_text):
        assert not re.search(r"\d (?:kB|MB|GB)(?!/s)", out)  # no decimal byte amounts (rates stay GB/s)


# -- rendering without the CLI --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    model = load_model(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("m")), device="cpu")
    trace = Trace("layers", hardware=PROFILES["laptop-cpu"])
    with trace.span("tokenize", text="abc") as e:
        e.update(n_tokens=4, token_ids=[1, 2, 3, 4], token_strings=["<s>", "a\n", " b", "[red]c"])
    list(generate(model, [1, 2, 3, 4], SamplingParams(max_new_tokens=5), trace=trace, eos_token_ids=[]))
    return model, trace


def render(trace, width=80) -> str:
    buf = StringIO()
    print_trace(trace, Console(file=buf, width=width, color_system=None))
    return buf.getvalue()


def test_rendering_fits_80_columns_and_keeps_markup_literal(tiny_trace):
    text = render(tiny_trace[1])
    assert max(len(line) for line in text.splitlines()) <= 80
    assert re.search(r"│ <s>·a\\n +│\n│  b·\[red\]c +│", text)  # boundaries, escapes, line breaks, no markup
    assert "Layers of step 0 (prefill)" in text and "Layers of step 1 (decode)" in text


def test_layers_print_their_shapes_once_then_one_row_per_layer(tiny_trace):
    model, trace = tiny_trace
    text = render(trace)
    n_layers = model.config.n_layers
    assert "Layers of step 0 (prefill): 2 layers, the same shapes in each" in text
    assert re.findall(r"(?m)^attention  (\S+ -> \S+)", text) == ["1x4x64 -> 1x4x64", "1x1x64 -> 1x1x64"]
    assert re.findall(r"(?m)^K/V cache  (\S+)", text) == ["1x2x4x16", "1x2x5x16"]
    rows = re.findall(r"(?m)^ +(\d+) +([\d.]+) +(█+) *$", text)  # one line per layer: no wrapping
    assert [int(r[0]) for r in rows] == list(range(n_layers)) * 2
    for step, pass_rows in ((0, rows[:n_layers]), (1, rows[n_layers:])):
        ms = [e["time_ms"] for e in trace.layers(step)]
        assert [float(r[1]) for r in pass_rows] == pytest.approx(ms, abs=0.006)
        assert [len(r[2]) for r in pass_rows] == [round(40 * t / max(ms)) for t in ms]  # bars scale with time


def test_roofline_title_and_numbers_fit_80_columns_without_scientific_notation(tiny_trace):
    trace = Trace.from_records(tiny_trace[1].to_records())
    trace.events = type(trace.events)(e for e in trace.events if e["kind"] != "roofline")
    trace.record_roofline(PROFILES["h200"])  # big peaks: 989.4 TFLOP/s, 4.8 TB/s; floors of microseconds
    text = render(trace)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "╭─ Roofline: h200 ─" in text
    assert "│ peaks    989,400 GFLOP/s, 4,800 GB/s, ridge 206 FLOP/byte" in text
    assert not re.search(r"\de[+-]\d", text)  # e.g. never "1.84e+03 ms" nor "6.1e-06 ms"


def test_without_a_tokenizer_tokens_show_as_ids(tiny_trace):
    trace = tiny_trace[1]  # recorded without a tokenizer
    text = render(trace)
    first = trace.prefill
    assert f"id {first['next_token_id']} (p={first['next_token_prob']:.2f}), greedy" in text
    top = "  ".join(f"id {c['token_id']} {c['prob']:.2f}" for c in first["candidates"][:2])
    assert f"top-5: {top}" in text and "''" not in text


@pytest.mark.parametrize("n_bytes, text", [
    (512, "512 B"), (46_080, "45.0 KiB"), (538_060_032, "513.1 MiB"), (16_060_522_496, "15.0 GiB"),
])
def test_one_byte_convention_iec(n_bytes, text):
    from minillm.units import fmt_bytes

    assert fmt_bytes(n_bytes) == text  # 46080 / 1024 = 45.0; 538060032 / 2**20 = 513.13; / 2**30 = 14.96


@pytest.mark.parametrize("value, text", [
    (1842.3, "1,842"), (12.34, "12.3"), (0.5034, "0.503"), (0.000123, "0.000123"), (989400.0, "989,400"),
])
def test_numbers_keep_three_digits_in_plain_decimals(value, text):
    from minillm.units import fmt_num

    assert fmt_num(value) == text


@pytest.mark.parametrize("load, share, reason", [
    (0.1, 0.98, "a short prompt gives each kernel too little work"),
    (9.0, 0.98, "this machine was busy (load average 9.0 on 2 CPUs)"),
    (1.5, 0.40, "other processes were running: this one got 40% of the CPU time its 2 threads could use"),
])
def test_a_verdict_off_the_textbook_is_explained(tiny_trace, load, share, reason):
    trace = Trace.from_records(tiny_trace[1].to_records())
    for e in trace.of("roofline"):
        e.update(bound="overhead-bound", roofline_fraction=0.05, load_average_1m=load, cpu_count=2,
                 torch_threads=2, cpu_share=share)
    text = " ".join(render(trace).replace("│", " ").split())  # the panel's text, unwrapped
    assert f"Textbook prefill is compute-bound. Not here, 20.0x its floor: {reason}" in text
    assert "Textbook decode is memory-bound. Not here, 20.0x its floor:" in text


def test_visible_escapes_control_characters():
    assert visible("a\nb\tc\x1b") == "a\\nb\\tc\\x1b"


def test_plots_write_nonempty_pngs(tiny_trace, tmp_path):
    model, trace = tiny_trace
    paths = plots.save_trace_plots(trace, tmp_path / "run")
    assert [p.name for p in paths] == ["timeline.png", "kv_cache.png", "roofline.png"]
    result = sweep(model, prompt_lengths=(4, 8), context_lengths=(8, 16), repeats=1, decode_steps=2,
                   hw=PROFILES["laptop-cpu"], name="tiny")
    assert len(result.ttft_ms) == 2 and len(result.tpot_floor_ms) == 2
    paths += plots.save_sweep_plots(result, tmp_path / "sweep")
    for p in paths:
        assert p.stat().st_size > 0
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths if p.suffix == ".png")
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text())["prompt_lengths"] == [4, 8]
    assert (tmp_path / "sweep" / "sweep.csv").read_text().splitlines()[0] == "measurement,tokens,ms,floor_ms"


def test_roofline_plot_needs_a_hardware_profile(tiny_trace):
    with pytest.raises(ValueError, match="no hardware profile"):
        plots.roofline(Trace())
