"""The benchmark harness on a tiny random model: engines, fields, ratios, the plot.

No timing assertions: speed targets live in the benchmark's output, not in tests.
"""

import json
import math

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, SamplingParams, generate, load_model
from minillm.baseline import generate_no_cache
from minillm.bench import (
    COLUMNS,
    ENGINES,
    BenchResult,
    check_targets,
    make_engines,
    plot,
    rich_table,
    run_bench,
    table_rows,
    to_json,
    to_markdown,
)
from minillm.hardware import HardwareProfile

HW = HardwareProfile("test-hw", peak_flops=1e11, mem_bandwidth=1e10)
PROMPTS, CONTEXTS, BATCHES = (8, 16), (8, 24), (1, 2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    return load_model(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("bench")), device="cpu")


@pytest.fixture(scope="module")
def result(model) -> BenchResult:
    pytest.importorskip("transformers")
    return run_bench(model, prompt_lengths=PROMPTS, context_lengths=CONTEXTS, batch_sizes=BATCHES, repeats=2,
                     decode_tokens=4, hardware=HW, memory_tokens=8, model_name="tiny")


def test_every_engine_measured_on_every_case(result):
    assert result.engines() == list(ENGINES)
    for engine in ENGINES:
        for length in PROMPTS:
            assert result.find(engine, "prefill", length, 1) is not None
        for batch in BATCHES:
            for length in CONTEXTS:
                m = result.find(engine, "decode", length, batch)
                assert m is not None, (engine, length, batch)
                assert len(m.times_ms) == 2 and m.time_ms > 0


def test_ratios_follow_from_the_measured_numbers(result, model):
    for m in result.measurements:
        ref = result.find("transformers", m.phase, m.length, m.batch_size)
        assert m.vs_reference == pytest.approx(m.tokens_per_s / ref.tokens_per_s)
        assert m.time_ms == pytest.approx(sorted(m.times_ms)[len(m.times_ms) // 2] if len(m.times_ms) % 2
                                          else sum(sorted(m.times_ms)[:2]) / 2)
        tokens = m.batch_size * (m.length if m.phase == "prefill" else 1)
        assert m.tokens_per_s == pytest.approx(tokens / m.time_ms * 1e3)
        assert m.floor_fraction == pytest.approx(m.floor_ms / m.time_ms)


def test_floors_come_from_the_cost_model(result, model):
    from minillm.costs import decode_cost, prefill_cost

    pre = result.find("minillm-sdpa", "prefill", 16)
    cost = prefill_cost(model.config, 16, 4)
    assert pre.floor_ms == pytest.approx(1e3 * max(cost.flops / HW.peak_flops, cost.bytes / HW.mem_bandwidth))
    dec = result.find("minillm-sdpa", "decode", 24, 2)
    cost = decode_cost(model.config, 24 + dec.decode_tokens // 2, 4, batch_size=2)
    assert dec.floor_ms == pytest.approx(1e3 * cost.bytes / HW.mem_bandwidth)


def test_all_engines_agree_on_the_greedy_tokens(result):
    compared = [m for m in result.measurements if m.engine != "minillm-sdpa"]
    assert compared and all(m.same_tokens for m in compared), [
        (m.engine, m.phase, m.length, m.batch_size) for m in compared if not m.same_tokens]


def test_json_has_all_fields(result, tmp_path):
    data = json.loads(to_json(result, tmp_path / "bench.json").read_text())
    assert {"model", "device", "dtype", "threads", "hardware", "measurements", "memory", "targets",
            "notes", "versions"} <= data.keys()
    row = data["measurements"][0]
    assert {"engine", "phase", "length", "batch_size", "time_ms", "times_ms", "tokens_per_s", "floor_ms",
            "floor_fraction", "vs_reference", "bound", "same_tokens"} <= row.keys()
    assert data["memory"]["generate_peak_bytes"] > 0 and "within_budget" in data["memory"]
    assert {t["name"] for t in data["targets"]} >= {"no-cache slowdown grows with context",
                                                   "memory: peak RSS generating (MB)"}


def test_table_and_markdown_show_every_measurement(result):
    rows = table_rows(result)
    assert len(rows) == len(result.measurements) and all(len(r) == len(COLUMNS) for r in rows)
    assert rich_table(result).row_count == len(rows)
    md = to_markdown(result)
    assert md.count("\n| prefill |") + md.count("\n| decode |") == len(rows)
    assert "x transformers" in md and "Memory" in md


def test_targets_are_checked_from_the_numbers(result):
    checks = {t.name: t for t in check_targets(result)}
    m = result.find("minillm-sdpa", "decode", 8)
    t = checks["decode ctx 8: x transformers"]
    assert t.measured == m.vs_reference and t.met == (m.vs_reference >= 1.5)


def test_plot_is_a_png(result, tmp_path):
    path = plot(result, tmp_path / "bench.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize("batch", [1, 3])
def test_no_cache_baseline_makes_minillms_greedy_tokens(model, batch):
    ids = torch.randint(0, model.config.vocab_size, (batch, 12), generator=torch.Generator().manual_seed(3))
    out = generate_no_cache(model, ids, 10)
    assert out.shape == (batch, 22) and torch.equal(out[:, :12], ids)
    for b in range(batch):
        steps = list(generate(model, ids[b], SamplingParams(max_new_tokens=10), eos_token_ids=[]))
        assert out[b, 12:].tolist() == [s.token_id for s in steps]


def test_no_cache_baseline_refuses_to_outgrow_the_context(model):
    ids = torch.zeros(1, model.config.max_seq_len, dtype=torch.long)
    with pytest.raises(ValueError, match="exceed the context"):
        generate_no_cache(model, ids, 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(repeats=0), "repeats"),
    (dict(decode_tokens=1), "decode_tokens"),
    (dict(prompt_lengths=(1,)), "prompt length"),
    (dict(context_lengths=(10_000,)), "context length"),
])
def test_bad_arguments_raise(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_bench(model, **{"prompt_lengths": (8,), "context_lengths": (8,), "batch_sizes": (1,),
                            "hardware": HW, "memory_tokens": 0, "engines": ("minillm-sdpa",), **kwargs})


def test_unknown_engine_is_an_error(model):
    with pytest.raises(ValueError, match="unknown engine"):
        make_engines(model, ["minillm-sdpa", "vllm"])


def test_decode_engine_restores_the_cache_between_repeats(model):
    engine, _ = make_engines(model, ["minillm-sdpa"])
    engine = engine[0]
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(5))
    cache = engine.prepare_decode(ids, 5)
    assert isinstance(cache, KVCache) and cache.length == 9
    first, second = engine.decode(ids, cache, 5), engine.decode(ids, cache, 5)
    assert first.tokens == second.tokens and len(first.gaps_s) == 4
    assert not math.isnan(first.ttft_s)


@pytest.mark.parametrize("engine_name", ["minillm-sdpa", "transformers"])
def test_batch_decode_setup_copies_one_row_to_every_row(model, engine_name):
    """The batch set-up prefills one row and copies it; the oracle is a batch-1 decode of that row."""
    if engine_name == "transformers":
        pytest.importorskip("transformers")
    engine = make_engines(model, [engine_name])[0][0]
    row = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))
    single = engine.decode(row, engine.prepare_decode(row, 6), 6).tokens
    batch = engine.decode(row.repeat(3, 1), engine.prepare_decode(row.repeat(3, 1), 6), 6).tokens
    assert batch == [step * 3 for step in single]


def test_minillm_batch_cache_equals_a_batch_prefill(model):
    engine = make_engines(model, ["minillm-sdpa"])[0][0]
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(8)).repeat(2, 1)
    copied = engine.prepare_decode(ids, 4)
    direct = KVCache.for_model(model, batch_size=2, max_seq_len=16)
    from minillm import prefill

    prefill(model, ids[:, :-1], direct)
    assert copied.length == direct.length == 11
    for layer in range(model.config.n_layers):
        torch.testing.assert_close(copied.keys(layer), direct.keys(layer))
        torch.testing.assert_close(copied.values(layer), direct.values(layer))


def test_compiled_engine_gets_its_own_target_rows(result):
    import copy

    with_compile = copy.deepcopy(result)
    for m in [m for m in result.measurements if m.engine == "minillm-sdpa" and m.phase == "decode"]:
        twin = copy.deepcopy(m)
        twin.engine, twin.vs_reference = "minillm-compile", 2.0
        with_compile.measurements.append(twin)
    checks = {t.name: t for t in check_targets(with_compile)}
    assert checks["decode ctx 8 (--compile): x transformers"].met is True
    assert "decode ctx 8 (--compile): x transformers" not in {t.name for t in check_targets(result)}


@pytest.mark.cli
def test_cli_quick_preset_yields_to_explicit_options(smollm2_dir, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "minillm", "bench", "--quick", "--engines", "minillm-sdpa",
                        "--prompt-lengths", "16", "--decode-tokens", "3", "--memory-tokens", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    cases = {(m["phase"], m["length"], m["decode_tokens"]) for m in data["measurements"]}
    assert cases == {("prefill", 16, 1), ("decode", 64, 3)}  # 16 and 3 given; context 64 from --quick
    assert data["repeats"] == 1 and data["memory"] is None


@pytest.mark.cli
def test_importing_minillm_leaves_the_compiler_out():
    """torch._dynamo (and sympy with it) is ~70 MB of RSS: only --compile may import it (the memory target)."""
    import subprocess
    import sys

    code = "import sys, minillm, minillm.generate, minillm.loading; print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["False", "False"], r.stderr


BAD_BENCH_OPTIONS = [
    (["--threads", "0"], "--threads must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--decode-tokens", "1"], "--decode-tokens must be >= 2"),
    (["--compile", "bogus"], "--compile: unknown mode 'bogus'"),
    (["--engines", "minillm-sdpa", "minillm-sdpa"], "lists minillm-sdpa more than once"),
    (["--json", "{tmp}/missing/b.json"], "does not exist"),
    (["--json", "{tmp}"], "is a folder"),
    (["--plot", "{tmp}/b.txt"], "must end in .png"),
    (["--memory-tokens", "9000"], "memory tokens must be in [0, 8176]"),
    (["--prompt-lengths", "0"], "prompt length 0 must be in"),
]


@pytest.mark.cli
def test_cli_bad_bench_option_exits_2_in_the_command(smollm2_dir):
    """The process path of the bench's usage errors (each of them below, in this process)."""
    import subprocess
    import sys

    args, message = BAD_BENCH_OPTIONS[0]
    r = subprocess.run([sys.executable, "-m", "minillm", "bench", "--quick", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


@pytest.mark.parametrize("args, message", BAD_BENCH_OPTIONS)
def test_cli_bad_bench_options_exit_2_before_the_work(run_main, smollm2_dir, tmp_path, args, message):
    """In this process (conftest's run_main), its thread count untouched (--threads is refused before
    torch.set_num_threads); the lengths after the model loads (its context), all before the bench."""
    threads = torch.get_num_threads()
    r = run_main("bench", "--quick", *(a.format(tmp=tmp_path) for a in args))
    assert torch.get_num_threads() == threads
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert "bench: warming up" not in r.stderr


def test_a_beaten_floor_is_noted_and_not_judged(result):
    import copy

    bad = copy.deepcopy(result)
    m = bad.find("minillm-sdpa", "decode", 8)
    m.floor_fraction = 3.0
    check = {t.name: t for t in check_targets(bad)}["decode ctx 8: fraction of floor"]
    assert check.met is None and "recalibrate" in check.detail
    from minillm.bench import beaten_floor_notes

    assert "understates" in beaten_floor_notes(bad.measurements, bad.hardware)[0]
    assert beaten_floor_notes(result.measurements, result.hardware) == []


def test_llama_cpp_engine_without_the_package_is_a_note(model, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp now fails, installed or not
    engines, notes = make_engines(model, ["minillm-sdpa", "llama.cpp"])
    assert [e.name for e in engines] == ["minillm-sdpa"]
    assert notes == ['llama-cpp-python is not installed: the llama.cpp engine was skipped (pip install '
                     '"minillm[llamacpp]"; it compiles llama.cpp, minutes)']


def test_cli_prints_the_install_hint_as_written():
    """The hint names the extra in brackets; the terminal must show them (rich markup once ate them)."""
    import io

    from rich.console import Console

    from minillm.bench.llama_cpp import INSTALL_HINT
    from minillm.cli.bench import print_notes

    out = io.StringIO()
    print_notes(Console(file=out, width=300), [INSTALL_HINT])
    assert out.getvalue() == f"- {INSTALL_HINT}\n" and '"minillm[llamacpp]"' in out.getvalue()


def test_llama_cpp_ratio_is_a_target_when_measured(result):
    import dataclasses

    sdpa = result.find("minillm-sdpa", "decode", 8, 1)
    peer = dataclasses.replace(sdpa, engine="llama.cpp", time_ms=sdpa.time_ms * 0.8,
                               tokens_per_s=sdpa.tokens_per_s / 0.8)
    with_peer = dataclasses.replace(result, measurements=result.measurements + [peer])
    check = {t.name: t for t in check_targets(with_peer)}["decode ctx 8: x llama.cpp"]
    assert check.measured == pytest.approx(0.8) and check.met is False and check.target == 0.9
    assert "decode ctx 8: x llama.cpp" not in {t.name for t in check_targets(result)}
