"""Choosing the decode path (minillm/decode_path.py) from fake timings, and every candidate's
logits against the plain path's. No timing is measured here: the choosing logic gets its ms."""

import json
import warnings

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, decode_step, load_model, prefill
from minillm import decode_path as dp
from minillm import model as model_module


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    return save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("decode_path"))


@pytest.fixture
def weights_dir(tmp_path, monkeypatch):
    """An empty calibration.json's folder, and no forced path."""
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path))
    monkeypatch.setenv(dp.ENV_VAR, "auto")
    yield tmp_path
    model_module.use_products("split")  # the process-wide switch back to the default


class FakeTimer:
    """measure(model, names) -> fixed ms per candidate; counts its calls."""

    def __init__(self, ms: dict[str, float]):
        self.ms, self.calls = ms, []

    def __call__(self, model, names):
        self.calls.append(list(names))
        return {name: self.ms[name] for name in names}


@pytest.mark.parametrize("timings, expected", [
    ({"long-rows+split": 36.0, "long-rows": 40.0, "row-major+split": 38.0, "row-major": 43.0}, "long-rows+split"),
    ({"long-rows+split": 44.0, "long-rows": 43.0, "row-major+split": 45.0, "row-major": 41.0}, "row-major"),
    ({"row-major": 41.0, "compile": 27.5}, "compile"),
    ({"row-major": 40.0, "long-rows": 40.0}, "long-rows"),  # a tie: the first listed in CANDIDATES
])
def test_choose_takes_the_fastest(timings, expected):
    assert dp.choose(timings) == expected


@pytest.mark.parametrize("timings, message", [({}, "no decode timings"), ({"fast": 1.0}, "unknown decode paths")])
def test_choose_refuses_bad_timings(timings, message):
    with pytest.raises(ValueError, match=message):
        dp.choose(timings)


def test_first_load_measures_the_eager_paths_then_the_cache_answers(folder, weights_dir):
    with pytest.warns(UserWarning, match="measuring the eager decode paths for this model on this machine"):
        model = load_model(folder, device="cpu")  # (auto: the real measurement of a tiny model, fast)
    assert model.decode_choice.source == "measured" and set(model.decode_choice.timings_ms) == set(dp.EAGER)
    timer = FakeTimer({"long-rows+split": 9.0, "long-rows": 8.0, "row-major+split": 7.0, "row-major": 6.0,
                       "matvec": 6.5})
    choice = dp.calibrate_decode_path(model, dp.EAGER, measure=timer)
    assert choice.name == "row-major" and model.decode_path == "row-major"
    assert not model.blocks[0].mlp.down_proj.weight.stride(0) == 1  # row-major: rows contiguous
    stored = json.loads((weights_dir / "calibration.json").read_text())[dp.decode_key(model.config)]
    assert stored["chosen"] == "row-major" and stored["timings_ms"] == timer.ms
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cached choice is silent
        again = dp.use_best_decode_path(model, measure=timer)
    assert (again.name, again.source, timer.calls) == ("row-major", "cached", [list(dp.EAGER)])


@pytest.mark.parametrize("winner, products, head_strides", [
    ("long-rows", "linear", lambda c: (1, c.vocab_size)),
    ("row-major+split", "split", lambda c: (c.d_model, 1)),
    ("matvec", "matvec", lambda c: (c.d_model, 1)),
])
def test_the_winner_sets_the_products_and_the_layout(folder, weights_dir, winner, products, head_strides):
    model = load_model(folder, device="cpu")
    dp.calibrate_decode_path(model, dp.EAGER, measure=FakeTimer(dict.fromkeys(dp.EAGER, 5.0) | {winner: 1.0}))
    assert model_module._products == products and model.lm_head.weight.stride() == head_strides(model.config)


def test_without_a_compiler_the_matvec_paths_are_not_measured(folder, weights_dir, monkeypatch):
    model = load_model(folder, device="cpu")
    monkeypatch.setattr(dp.matvec_kernels, "available", lambda: False)
    timer = FakeTimer(dict.fromkeys(dp.CANDIDATES, 5.0))
    choice = dp.calibrate_decode_path(model, measure=timer)
    assert timer.calls == [[n for n in dp.CANDIDATES if "matvec" not in n]] and "matvec" not in choice.name


@pytest.fixture
def no_cxx():
    """torch.compile's inductor finds no C++ compiler (as where none is installed)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": (None, "no-such-compiler-minillm")}):
        yield


def test_without_a_cxx_compiler_the_compiled_paths_are_not_measured(folder, weights_dir, no_cxx):
    assert dp.compile_unavailable().startswith("torch.compile finds no C++ compiler (No working C++ compiler found")
    model = load_model(folder, device="cpu")
    timer = FakeTimer(dict.fromkeys(dp.CANDIDATES, 5.0))
    dp.calibrate_decode_path(model, measure=timer)  # (was: inductor's error from the first compiled step)
    assert timer.calls == [[n for n in dp.CANDIDATES if not dp.CANDIDATES[n].compiled]]


def test_without_a_cxx_compiler_a_compiled_path_is_refused_or_measured_again(folder, weights_dir, monkeypatch,
                                                                              no_cxx):
    monkeypatch.setenv(dp.ENV_VAR, "compile+matvec")
    with pytest.raises(ValueError, match=r"^MINILLM_DECODE_PATH=compile\+matvec cannot run here: torch.compile "
                                         r"finds no C\+\+ compiler .*; install one \(g\+\+\) or choose an eager path"):
        load_model(folder, device="cpu")
    monkeypatch.setenv(dp.ENV_VAR, "auto")
    model = load_model(folder, device="cpu")
    dp.calibrate_decode_path(model, measure=FakeTimer(dict.fromkeys(dp.EAGER, 5.0)))
    stored = json.loads((weights_dir / "calibration.json").read_text())
    stored[dp.decode_key(model.config)]["chosen"] = "compile"  # kept where a compiler was, since removed
    (weights_dir / "calibration.json").write_text(json.dumps(stored))
    timer = FakeTimer(dict.fromkeys(dp.EAGER, 5.0) | {"matvec": 1.0})
    with pytest.warns(UserWarning, match="measuring the eager decode paths"):
        choice = dp.use_best_decode_path(model, measure=timer)
    assert (choice.name, choice.source, timer.calls) == ("matvec", "measured", [list(dp.EAGER)])


def test_another_model_shape_is_measured_on_its_own(folder, weights_dir, tmp_path):
    model = load_model(folder, device="cpu")
    family, kwargs = CONFIGS["llama_gqa"]
    other = load_model(save_hf(build_hf(family, {**kwargs, "num_hidden_layers": 1}), tmp_path / "one_layer"), device="cpu")
    assert dp.decode_key(model.config) != dp.decode_key(other.config)
    assert {dp.decode_key(model.config), dp.decode_key(other.config)} <= json.loads((weights_dir / "calibration.json").read_text()).keys()


def test_the_environment_forces_a_path_without_measuring(folder, weights_dir, monkeypatch):
    monkeypatch.setenv(dp.ENV_VAR, "long-rows")
    model = load_model(folder, device="cpu")
    assert (model.decode_choice.name, model.decode_choice.source, model.decode_path) == ("long-rows", "forced",
                                                                                        "long-rows")
    assert not (weights_dir / "calibration.json").exists()
    monkeypatch.setenv(dp.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="MINILLM_DECODE_PATH='fastest' is not a decode path; use one of"):
        load_model(folder, device="cpu")


def test_an_empty_environment_variable_reads_as_unset(folder, weights_dir, monkeypatch):
    model = load_model(folder, device="cpu")
    monkeypatch.setenv(dp.ENV_VAR, "")  # `MINILLM_DECODE_PATH= minillm ...` (was: "'' is not a decode path")
    timer = FakeTimer(dict.fromkeys(dp.EAGER, 5.0) | {"row-major": 1.0})
    (weights_dir / "calibration.json").unlink()
    choice = dp.use_best_decode_path(model, measure=timer)
    assert (choice.name, choice.source, timer.calls) == ("row-major", "measured", [list(dp.EAGER)])


def test_not_cpu_float32_keeps_the_default(folder, weights_dir):
    model = load_model(folder, device="cpu", dtype="bfloat16")
    assert (model.decode_path, model.decode_choice.source) == ("default", "default")
    assert not (weights_dir / "calibration.json").exists()


def _decode_logits(model, ids, n_steps=4):
    cache = KVCache.for_model(model, max_seq_len=ids.shape[1] + n_steps)
    logits = [prefill(model, ids, cache)]
    for _ in range(n_steps):
        logits.append(decode_step(model, logits[-1].argmax(-1), cache))
    return torch.stack(logits)


@pytest.mark.parametrize("name", [n for n in dp.CANDIDATES if n != dp.PLAIN])
def test_every_candidate_gives_the_plain_paths_logits(folder, name):
    model = load_model(folder, device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split product cuts a matrix into one block per thread
    try:
        expected = _decode_logits(dp.apply_decode_path(model, dp.PLAIN), ids)
        got = _decode_logits(dp.apply_decode_path(model, name), ids)
    finally:
        model_module.use_products("split")
        torch.set_num_threads(threads)
    assert model.decode_path == name
    assert (got - expected).abs().max().item() < 1e-4


def test_calibrate_shows_the_cached_choice(folder, weights_dir, monkeypatch, capsys):
    from minillm.cli import main

    choice = load_model(folder, device="cpu").decode_choice  # (auto: measured at this first load)
    monkeypatch.setenv("COLUMNS", "400")  # one line, unwrapped
    assert main(["calibrate", "--quick", "--model", str(folder)]) == 0
    assert f"decode path of {folder} on cpu float32: {choice.name} (cached; decode ms/step: " in capsys.readouterr().out


def test_the_trace_names_the_decode_path(folder, weights_dir, monkeypatch):
    from rich.console import Console

    from minillm import SamplingParams, Trace, generate
    from minillm.render import summary_panel

    monkeypatch.setenv(dp.ENV_VAR, "row-major+split")
    model, trace = load_model(folder, device="cpu"), Trace()
    list(generate(model, [1, 2, 3], SamplingParams(max_new_tokens=3), trace=trace, eos_token_ids=[]))
    assert trace.first("model")["decode_path"] == "row-major+split"
    console = Console(record=True, width=200)
    console.print(summary_panel(trace))
    assert "path        row-major+split  decode path (minillm/decode_path.py)" in console.export_text()


def test_generate_on_a_compiled_path_says_its_first_step_compiles(tmp_path, smollm2_dir, weights_dir, monkeypatch,
                                                                   capsys):
    """One line on stderr before the answer (TPOT once read 12.6 s with no word why); none on an
    eager path or with --warmup. (One new token: the prefill's, so only the warm-up compiles.)"""
    import shutil

    from minillm.cli import main

    family, kwargs = CONFIGS["llama_gqa"]
    tiny = save_hf(build_hf(family, {**kwargs, "vocab_size": 49152}), tmp_path / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tiny / name)
    for path, flags, warned in (("compile+matvec", [], True), ("matvec", [], False),
                                ("compile+matvec", ["--warmup"], False)):  # (the warm-up compiles it)
        monkeypatch.setenv(dp.ENV_VAR, path)
        assert main(["generate", "--model", str(tiny), "--max-new-tokens", "1", *flags, "hi"]) == 0
        err = capsys.readouterr().err
        assert ("minillm: warning: decode path compile+matvec (forced by MINILLM_DECODE_PATH): this process "
                "compiles its first decode step" in err) is warned


def test_calibrate_says_how_to_skip_a_kept_compiled_path(folder, weights_dir, monkeypatch, capsys):
    from minillm.cli import main

    fake = dict.fromkeys(dp.CANDIDATES, 9.0) | {"compile+matvec": 4.0, "row-major+split": 6.0}
    monkeypatch.setattr(dp, "measure_decode_paths", lambda model, names, **kw: {n: fake[n] for n in names})
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["calibrate", "--quick", "--decode-path", "--model", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "compile+matvec (measured; decode ms/step: compile+matvec 4.0, row-major+split 6.0" in out
    assert "for one-shot commands MINILLM_DECODE_PATH=row-major+split runs the fastest eager path" in out
