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
from minillm import plots
from minillm.hardware import PROFILES
from minillm.render import print_trace, visible
from minillm.sweep import sweep
from minillm.trace import Trace

from tiny_models import CONFIGS, build_hf, save_hf

GOLDEN = Path(__file__).parent / "golden" / "generate_trace.txt"
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


def test_cli_trace_matches_the_golden_text(cli_run):
    r, _ = cli_run
    got = mask_timings(r.stdout)
    if os.environ.get("MINILLM_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text(), "rendering changed; rerun with MINILLM_UPDATE_GOLDEN=1 if intended"


def test_cli_trace_shows_every_phase_within_80_columns(cli_run):
    out = cli_run[0].stdout
    for title in ("Prompt: ", "Prefill", "Steps: ", "Summary", "Roofline: "):
        assert f"╭─ {title}" in out
    assert len(re.findall(r"(?m)^│ +\d+ +\d+  '", out)) == 8  # one row per generated token
    for verdict in re.findall(r"(?m)^│ (prefill|decode) +(\S+)", out):
        assert verdict[1] in ("compute-bound", "memory-bound", "overhead-bound")
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "\x1b[" not in out  # plain text when not a terminal


def test_cli_trace_out_and_plots(cli_run):
    _, out = cli_run
    records = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("prefill") == 1 and kinds.count("decode") == 7
    assert {"tokenize", "metrics", "detokenize", "roofline", "model", "warmup"} <= set(kinds)
    metrics = next(r for r in records if r["kind"] == "metrics")
    prefill = next(r for r in records if r["kind"] == "prefill")
    assert metrics["ttft_ms"] == pytest.approx(prefill["end_ms"], abs=1e-6)
    for name in ("timeline.png", "kv_cache.png", "roofline.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
