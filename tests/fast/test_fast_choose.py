"""The speed layer's choice of decode path (minillm/fast/choose.py) and what applying one keeps.

How a path is chosen: forced by MINILLM_DECODE_PATH, cached by ``minillm calibrate --decode-path``,
else the rule; loading never times anything (a measurement fails these tests). The calibration's
choosing logic gets fake timings. What a path must keep: the pure model's parameter names, tensors
and logits (the oracle: the same checkpoint loaded with ``fast=False``), and a member replaced after
stacking must be what runs. The swap table (minillm.fast.SWAPS) is what the paths swap in.
"""

import importlib
import json
import re

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf
from torch import nn

import minillm.fast
from minillm import KVCache, decode_step, load_model, prefill
from minillm.fast import choose as dp
from minillm.fast.attention import c_decode_fits, c_kernels_fit
from minillm.fast.products import LINEARS, FastQuantizedLinear, MatvecLinear, SplitLinear
from minillm.fast.replay import ReplayedDecodeStep
from minillm.quantize import QuantizedLinear
from minillm.serving.paged_attention import forward_batch

TOL = 1e-5  # float32: the same products summed in another order


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny checkpoints: llama_gqa (SwiGLU, untied), gpt2 (GELU MLP, biases, tied), llama_mqa_tied, qwen3_bias."""
    root = tmp_path_factory.mktemp("fast_choose")
    return {name: save_hf(build_hf(*CONFIGS[name]), root / name)
            for name in ("llama_gqa", "gpt2", "llama_mqa_tied", "qwen3_bias")}


@pytest.fixture(scope="module")
def folder(folders):
    return folders["llama_gqa"]


@pytest.fixture
def weights_dir(tmp_path, monkeypatch):
    """An empty calibration.json's folder, and no forced path."""
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path))
    monkeypatch.delenv(dp.ENV_VAR, raising=False)
    return tmp_path


def _refuse(*args, **kwargs):
    raise AssertionError("a decode path was measured")


@pytest.fixture
def no_measuring(monkeypatch):
    """Any measurement of a decode path fails the test (a FakeTimer's may stand in)."""
    for name in ("measure_decode_paths", "prefill", "decode_step"):
        monkeypatch.setattr(dp, name, _refuse)


class FakeTimer:
    """measure(model, names) -> fixed ms per candidate; counts its calls."""

    def __init__(self, ms: dict[str, float]):
        self.ms, self.calls = ms, []

    def __call__(self, model, names):
        self.calls.append(list(names))
        return {name: self.ms[name] for name in names}


def _runnable(names):
    """The candidates calibrate measures here (the matvec ones only where the C kernels build)."""
    return [n for n in names if dp.CANDIDATES[n].products != "matvec" or dp.kernels.available()]


def _rule() -> str:
    return "replay" if dp.kernels.available() else "row-major+split"


# -- choosing ------------------------------------------------------------------------------------


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


def test_load_model_never_measures(folder, weights_dir, no_measuring, monkeypatch):
    """No forced path, no cached choice: the rule, and nothing timed or written."""
    monkeypatch.setattr(dp, "calibrate_decode_path", _refuse)
    model = load_model(folder, device="cpu")
    assert model.decode_choice == dp.DecodeChoice(_rule(), "rule", {}) and model.decode_path == _rule()
    assert not (weights_dir / "calibration.json").exists()


@pytest.mark.parametrize("kernels_build", [True, False])
def test_the_rule_is_the_c_path_where_the_kernels_build(folder, weights_dir, no_measuring, monkeypatch,
                                                        kernels_build):
    if kernels_build and not dp.kernels.available():
        pytest.skip("needs the C kernels")
    monkeypatch.setattr(dp.kernels, "available", lambda: kernels_build)
    model = load_model(folder, device="cpu")
    attn = model.blocks[0].attn
    expected, linear = ("replay", MatvecLinear) if kernels_build else ("row-major+split", SplitLinear)
    assert (model.decode_path, model.decode_choice.source) == (expected, "rule")
    assert type(attn.qkv.module) is type(attn.q_proj) is type(model.lm_head) is linear
    assert attn.c_decode == (kernels_build and c_decode_fits(model))


def test_the_environment_forces_a_path_without_measuring(folder, weights_dir, no_measuring, monkeypatch):
    monkeypatch.setenv(dp.ENV_VAR, "long-rows")
    model = load_model(folder, device="cpu")
    assert model.decode_choice == dp.DecodeChoice("long-rows", "forced", {}) and model.decode_path == "long-rows"
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.stride() == (1, model.config.vocab_size)
    assert not (weights_dir / "calibration.json").exists()
    monkeypatch.setenv(dp.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match=r"MINILLM_DECODE_PATH='fastest' is not a decode path for a model in float32; "
                                         r"use one of long-rows\+split, .* \(or auto\)"):
        load_model(folder, device="cpu")


def test_an_empty_environment_variable_reads_as_unset(folder, weights_dir, no_measuring, monkeypatch):
    monkeypatch.setenv(dp.ENV_VAR, "")  # `MINILLM_DECODE_PATH= minillm ...` (was: "'' is not a decode path")
    assert load_model(folder, device="cpu").decode_choice == dp.DecodeChoice(_rule(), "rule", {})


def test_calibrate_caches_the_fastest_and_the_next_load_takes_it(folder, weights_dir, no_measuring):
    model = load_model(folder, device="cpu")
    timer = FakeTimer({"long-rows+split": 9.0, "long-rows": 8.0, "row-major+split": 7.0, "row-major": 6.0,
                       "matvec": 6.5, "replay": 6.2})
    choice = dp.calibrate_decode_path(model, dp.EAGER, measure=timer)
    assert (choice.name, choice.source, choice.timings_ms) == ("row-major", "measured", {
        n: timer.ms[n] for n in _runnable(dp.EAGER)})
    assert model.decode_path == "row-major" and model.blocks[0].mlp.down_proj.weight.stride(1) == 1  # rows contiguous
    stored = json.loads((weights_dir / "calibration.json").read_text())[dp.decode_key(model.config)]
    assert stored["chosen"] == "row-major" and stored["timings_ms"] == choice.timings_ms
    again = load_model(folder, device="cpu")  # (no_measuring: the cache answers)
    assert (again.decode_path, again.decode_choice.source, again.decode_choice.timings_ms) == (
        "row-major", "cached", choice.timings_ms)
    assert timer.calls == [_runnable(dp.EAGER)]


@pytest.mark.parametrize("winner, linear, head_strides", [
    ("long-rows", nn.Linear, lambda c: (1, c.vocab_size)),
    ("row-major+split", SplitLinear, lambda c: (c.d_model, 1)),
    ("matvec", MatvecLinear, lambda c: (c.d_model, 1)),
    ("replay", MatvecLinear, lambda c: (c.d_model, 1)),
])
def test_the_winner_swaps_in_its_products_and_layout(folder, weights_dir, winner, linear, head_strides):
    in_c = dp.CANDIDATES[winner].products == "matvec"
    if in_c and not dp.kernels.available():
        pytest.skip("needs the C kernels")
    model = load_model(folder, device="cpu")
    dp.calibrate_decode_path(model, dp.EAGER, measure=FakeTimer(dict.fromkeys(dp.EAGER, 5.0) | {winner: 1.0}))
    attn, mlp = model.blocks[1].attn, model.blocks[1].mlp
    assert model.decode_path == winner
    assert type(model.lm_head) is type(attn.qkv.module) is type(mlp.gate_up.module) is type(mlp.down_proj) is linear
    assert model.lm_head.weight.stride() == head_strides(model.config)
    assert attn.c_decode == in_c


def test_without_a_compiler_the_matvec_paths_are_not_measured(folder, weights_dir, monkeypatch):
    model = load_model(folder, device="cpu")
    monkeypatch.setattr(dp.kernels, "available", lambda: False)
    timer = FakeTimer(dict.fromkeys(dp.CANDIDATES, 5.0))
    choice = dp.calibrate_decode_path(model, measure=timer)
    in_python = [n for n, p in dp.CANDIDATES.items() if p.products != "matvec"]
    assert timer.calls == [in_python] and choice.name in in_python


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
    assert timer.calls == [_runnable(n for n in dp.CANDIDATES if not dp.CANDIDATES[n].compiled)]


def test_without_a_cxx_compiler_a_compiled_path_is_refused_or_left_to_the_rule(folder, weights_dir, monkeypatch,
                                                                                no_measuring, no_cxx):
    monkeypatch.setenv(dp.ENV_VAR, "compile+matvec")
    with pytest.raises(ValueError, match=r"^MINILLM_DECODE_PATH=compile\+matvec cannot run here: torch.compile "
                                         r"finds no C\+\+ compiler .*; install one \(g\+\+\) or choose an eager path"):
        load_model(folder, device="cpu")
    monkeypatch.delenv(dp.ENV_VAR)
    model = load_model(folder, device="cpu", fast=False)
    dp.save_measurement(dp.decode_key(model.config), "cpu", {"chosen": "compile", "timings_ms": {"compile": 1.0}})
    choice = load_model(folder, device="cpu").decode_choice  # kept where a compiler was, since removed
    assert choice == dp.DecodeChoice(_rule(), "rule", {})


def test_another_model_shape_is_chosen_on_its_own(folder, weights_dir, tmp_path, no_measuring):
    model = load_model(folder, device="cpu")
    family, kwargs = CONFIGS["llama_gqa"]
    one_layer = save_hf(build_hf(family, {**kwargs, "num_hidden_layers": 1}), tmp_path / "one_layer")
    assert dp.decode_key(model.config) != dp.decode_key(load_model(one_layer, device="cpu", fast=False).config)
    dp.save_measurement(dp.decode_key(model.config), "cpu", {"chosen": "long-rows", "timings_ms": {"long-rows": 1.0}})
    assert load_model(folder, device="cpu").decode_choice.source == "cached"
    assert load_model(one_layer, device="cpu").decode_choice == dp.DecodeChoice(_rule(), "rule", {})


@pytest.mark.parametrize("dtype, long_rows", [("bfloat16", True), ("float16", False), ("float64", True)])
def test_not_cpu_float32_gets_the_default_path(folder, weights_dir, no_measuring, dtype, long_rows):
    """Stacked F.linear products; long rows but in float16 (its CPU products with transposed weights are slow);
    bfloat16 where the C kernels build: row-major MatvecLinear (its few rows in C)."""
    model = load_model(folder, device="cpu", dtype=dtype)
    gate_up = model.blocks[0].mlp.gate_up.module
    linear, expected = nn.Linear, dp.DecodeChoice("default", "default", {})
    if dtype == "bfloat16" and dp.kernels.available():  # (the rule's replayed C step)
        linear, long_rows, expected = MatvecLinear, False, dp.DecodeChoice("replay", "rule", {})
    assert model.decode_choice == expected and model.decode_path == expected.name
    assert type(gate_up) is linear and gate_up.weight.t().is_contiguous() == long_rows
    assert not (weights_dir / "calibration.json").exists()


@pytest.mark.skipif(not dp.kernels.available() or dp.compile_unavailable() is not None,
                    reason="needs the C kernels and torch.compile's C++ compiler")
@pytest.mark.parametrize("precision, load", [("bfloat16", dict(dtype="bfloat16")), ("int8", dict(quantize="int8")),
                                             ("int4", dict(quantize="int4"))])
def test_bfloat16_and_quantised_models_keep_their_own_choice_of_their_own_candidates(folder, weights_dir, no_measuring,
                                                                                     precision, load):
    """calibrate measures such a model's two candidates (its products in C, eager or compiled) and keeps the winner
    under its precision's key: the next load in that precision takes it, a float32 load keeps its rule."""
    model = load_model(folder, device="cpu", **load)
    assert dp.precision_of(model) == precision
    timer = FakeTimer({"matvec": 9.0, "replay": 8.0, "compile+matvec": 6.0})
    choice = dp.calibrate_decode_path(model, measure=timer)
    assert (choice.name, choice.timings_ms, timer.calls) == ("compile+matvec", timer.ms, [list(dp.C_CANDIDATES)])
    key = dp.decode_key(model.config, precision)
    assert key.startswith(f"decode_path/cpu/{precision}/") and key.replace(precision, "float32") == dp.decode_key(
        model.config)
    assert json.loads((weights_dir / "calibration.json").read_text())[key]["chosen"] == "compile+matvec"
    again = load_model(folder, device="cpu", **load)
    assert (again.decode_path, again.decode_choice.source) == ("compile+matvec", "cached")
    assert again.compiled_decode is not None
    f32 = load_model(folder, device="cpu")
    assert (f32.decode_path, f32.decode_choice.source, type(f32.compiled_decode)) == (_rule(), "rule",
                                                                                     ReplayedDecodeStep)


@pytest.mark.parametrize("name", ["row-major", "MATVEC"])
def test_the_environment_forces_a_bfloat16_model_only_onto_its_candidates(folder, weights_dir, monkeypatch, name):
    """A float32-only path and an unknown name are refused alike, naming bfloat16's own candidates."""
    monkeypatch.setenv(dp.ENV_VAR, name)
    with pytest.raises(ValueError, match=rf"^MINILLM_DECODE_PATH='{name}' is not a decode path for a model in "
                                         r"bfloat16; use one of matvec, replay, compile\+matvec \(or auto\)$"):
        load_model(folder, device="cpu", dtype="bfloat16")
    monkeypatch.setenv(dp.ENV_VAR, "matvec")
    model = load_model(folder, device="cpu", dtype="bfloat16")
    assert (model.decode_path, model.decode_choice.source) == ("matvec", "forced")


@pytest.mark.parametrize("precision, load", [("bfloat16", dict(dtype="bfloat16")), ("int8", dict(quantize="int8"))])
@pytest.mark.parametrize("kept", ["row-major", "compile", "nonsense"])
def test_a_kept_choice_that_is_no_candidate_of_its_precision_is_ignored(folder, weights_dir, no_measuring, precision,
                                                                        load, kept):
    """A hand-edited calibration.json naming a float32-only path (or none) for a bfloat16 or int8 model: the model
    runs its default, as with nothing kept (it ran the named path, one the environment variable is refused)."""
    model = load_model(folder, device="cpu", **load)
    dp.save_measurement(dp.decode_key(model.config, precision), "cpu", {"chosen": kept, "timings_ms": {kept: 1.0}})
    assert dp.load_decode_choice(model.config, precision) is None
    again = load_model(folder, device="cpu", **load)
    assert again.decode_choice.source in ("default", "rule") and not getattr(again.compiled_decode, "compiles", False)


def test_decode_paths_are_measured_in_float32_bfloat16_int8_or_int4_only(folder, weights_dir, capsys):
    from minillm.cli import main

    model = load_model(folder, device="cpu", dtype="float16")
    with pytest.raises(ValueError, match=r"^decode paths are measured on the CPU in float32, bfloat16, int8 or int4, "
                                         r"got float16 on cpu; load the model with device='cpu' and one of those$"):
        dp.calibrate_decode_path(model, measure=_refuse)
    assert main(["calibrate", "--quick", "--decode-path", "--dtype", "float16", "--model", str(folder)]) == 2
    assert capsys.readouterr().err.strip() == ("minillm: error: --decode-path measures float32 or bfloat16 decode "
                                               "paths, got --dtype float16; pass --dtype float32 or --dtype bfloat16")
    assert main(["calibrate", "--quick", "--decode-path", "--quantize", "int8", "--dtype", "bfloat16",
                 "--model", str(folder)]) == 2
    assert capsys.readouterr().err.strip() == ("minillm: error: --quantize int8's models compute in float32, got "
                                               "--dtype bfloat16; drop --dtype to measure their decode paths")


def test_an_unknown_path_is_refused_before_anything_is_swapped(folder):
    model = load_model(folder, device="cpu", fast=False)
    with pytest.raises(ValueError, match=r"'mkl' is not a decode path; use one of long-rows\+split, .* \(or default\)"):
        dp.apply_decode_path(model, "mkl")
    assert model.decode_path is None and type(model.blocks[0].attn.q_proj) is nn.Linear


# -- what a path keeps ---------------------------------------------------------------------------


def _decode_logits(model, ids, n_steps=4):
    """Prefill's logits, then n_steps greedy decode steps', [1 + n_steps, B, vocab]."""
    cache = KVCache.for_model(model, batch_size=ids.shape[0], max_seq_len=ids.shape[1] + n_steps)
    logits = [prefill(model, ids, cache)]
    for _ in range(n_steps):
        logits.append(decode_step(model, logits[-1].argmax(-1), cache))
    return torch.stack(logits)


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split product cuts a matrix into one block per thread
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", dp.CANDIDATES)
def test_every_candidate_gives_the_pure_models_logits(folder, name, two_threads):
    """Prefill and decode steps at batch 2 (the compiled ones: one compile each, seconds)."""
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    expected = _decode_logits(load_model(folder, device="cpu", fast=False), ids)
    model = dp.apply_decode_path(load_model(folder, device="cpu", fast=False), name)
    path = dp.CANDIDATES[name]
    assert model.decode_path == name and (model.compiled_decode is not None) == (path.compiled or path.replayed)
    torch.testing.assert_close(_decode_logits(model, ids), expected, atol=TOL, rtol=0)


def _pure_and_fast(folder, path, quantize=None):
    pure = load_model(folder, device="cpu", fast=False, quantize=quantize)
    return pure, dp.apply_decode_path(load_model(folder, device="cpu", fast=False, quantize=quantize), path)


@pytest.mark.parametrize("config, path, quantize", [
    *((c, p, None) for c in ("gpt2", "llama_mqa_tied", "qwen3_bias") for p in dp.EAGER),
    ("llama_gqa", "compile+matvec", None),
    *((c, p, q) for c in ("gpt2", "llama_mqa_tied") for p in ("matvec", "replay", "long-rows+split")
       for q in ("int8", "int4")),
])
def test_a_path_keeps_the_pure_models_names_tensors_and_classes(folders, config, path, quantize):
    """Every module is still its course class (a subclass swapped in), at the same name; state_dict keys,
    parameter and buffer names and values, byte and parameter counts and the tied head are the pure
    model's: checkpoints and prefix-cache fingerprints see no difference."""
    pure, fast = _pure_and_fast(folders[config], path, quantize)
    modules = dict(fast.named_modules())
    assert modules.keys() == dict(pure.named_modules()).keys()
    assert all(isinstance(modules[name], type(m)) for name, m in pure.named_modules())
    expected, got = pure.state_dict(), fast.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in pure.named_parameters()]
    assert [n for n, _ in fast.named_buffers()] == [n for n, _ in pure.named_buffers()]
    assert (fast.num_parameters(), fast.weights_bytes()) == (pure.num_parameters(), pure.weights_bytes())
    assert (getattr(fast.lm_head, "weight", None) is fast.embed.weight) == (
        getattr(pure.lm_head, "weight", None) is pure.embed.weight)
    if quantize:
        assert all(type(m) is FastQuantizedLinear for m in fast.modules() if isinstance(m, QuantizedLinear))
    elif path in LINEARS:  # (a path named after its products)
        assert type(fast.lm_head) is LINEARS[path]


def _replace(model, fmt, q_weight, gate_weight):
    """Four edits after stacking: a q_proj module swapped in (block 0), a gate_proj tensor assigned
    (block 1), up_proj's ``.data`` set to another tensor (block 0), k_proj's numbers changed in place
    (block 1)."""
    c = model.config
    if fmt is None:
        q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False).requires_grad_(False)
        q_proj.weight.copy_(q_weight)
        model.blocks[1].mlp.gate_proj.weight = nn.Parameter(gate_weight.clone(), requires_grad=False)
        model.blocks[0].mlp.up_proj.weight.data = gate_weight.clone()
        model.blocks[1].attn.k_proj.weight.mul_(2)
    else:
        q_proj = QuantizedLinear(q_weight, None, fmt)
        model.blocks[1].mlp.gate_proj.qweight = QuantizedLinear(gate_weight, None, fmt).qweight
        model.blocks[0].mlp.up_proj.qweight.data = QuantizedLinear(gate_weight, None, fmt).qweight
        model.blocks[1].attn.k_proj.scale.mul_(2)
    model.blocks[0].attn.q_proj = q_proj


@pytest.mark.parametrize("path", ["long-rows+split", "matvec", "row-major"])
def test_gradients_reach_every_parameter_as_in_the_pure_model(folder, path):
    """With every parameter requiring grad, a backward pass through the fast model gives each one the pure model's
    gradient: the stacks step aside while autograd records (q|k|v and gate|up got none: a new user's trial)."""
    pure, fast = _pure_and_fast(folder, path)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    for model in (pure, fast):
        model.requires_grad_(True)
        model(ids).float().logsumexp(-1).sum().backward()
    grads = {name: p.grad for name, p in fast.named_parameters()}
    for name, p in pure.named_parameters():
        assert grads[name] is not None, name
        torch.testing.assert_close(grads[name], p.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["long-rows+split", "matvec", "row-major"])
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_member_replaced_after_stacking_is_what_runs(folder, path, quantize):
    """A module or tensor put in a stacked member's place takes over from the stack (a stale q|k|v or
    gate|up product would keep the old weights); an edit in place reaches the stack (its rows are the
    members' own). The oracle: the pure model with the same edits."""
    pure, fast = _pure_and_fast(folder, path, quantize)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    before = _decode_logits(pure, ids)
    g = torch.Generator().manual_seed(6)
    c = pure.config
    q_weight = torch.randn(c.n_heads * c.head_dim, c.d_model, generator=g) * 0.2
    gate_weight = torch.randn(c.d_mlp, c.d_model, generator=g) * 0.2
    for model in (pure, fast):
        _replace(model, quantize, q_weight, gate_weight)
    assert not fast.blocks[0].attn.qkv.fresh(fast.blocks[0].attn)
    assert not fast.blocks[1].mlp.gate_up.fresh(fast.blocks[1].mlp)
    assert not fast.blocks[0].mlp.gate_up.fresh(fast.blocks[0].mlp)  # (.data set: the same Parameter, new numbers)
    assert fast.blocks[1].attn.qkv.fresh(fast.blocks[1].attn)  # (the in-place edit: still the stack, which sees it)
    expected = _decode_logits(pure, ids)
    assert (expected - before).abs().max() > 0.1  # the edits matter
    torch.testing.assert_close(_decode_logits(fast, ids), expected, atol=TOL, rtol=0)
    assert list(fast.state_dict()) == list(pure.state_dict())


# -- the swap table (minillm/fast/__init__.py) -----------------------------------------------------


def _resolve(name: str):
    """A name of the swap table as the object it names: "torch.nn.Linear", else dotted under minillm."""
    module, _, attr = (name if name.startswith("torch.") else f"minillm.{name}").rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _swapped(pure, fast) -> set[tuple]:
    """(course piece, fast piece) of each swap a path made: the module at a name whose class changed
    (stacked members included), the serving batch's builder, the compiled or replayed decode step, the replayed
    serving step."""
    modules = dict(fast.named_modules())
    pairs = {(type(m), type(modules[name])) for name, m in pure.named_modules() if type(modules[name]) is not type(m)}
    if getattr(fast, "paged_batch", None) is not None:  # (the builder of each step's FastPagedBatch)
        pairs.add((_resolve("serving.paged_attention.PagedBatch"), _resolve("fast.paged_attention.FastPagedBatch")))
    if fast.compiled_decode is not None:
        pairs.add((decode_step, type(fast.compiled_decode)))
    if getattr(fast, "replayed_batch", None) is not None:  # (the serving engine's step of decodes)
        pairs.add((forward_batch, type(fast.replayed_batch)))
    return pairs


def _paths(swap) -> list[str]:
    """The decode paths a row's ``when`` names: "every path", or their names."""
    if swap.when.startswith("every path"):
        return list(dp.CANDIDATES)
    return [n for n in dp.CANDIDATES if re.search(rf"(?<![\w+-]){re.escape(n)}(?![\w+-])", swap.when)]


def _applies(swap, path: str, model, quantized: bool) -> bool:
    """Whether a row's ``when`` (its words: the paths, then the conditions) covers this path and model."""
    conditions = {"C kernels fit": c_kernels_fit(model),
                  "a float model": not quantized, "a quantised model": quantized,
                  "a SwiGLU MLP": model.config.model_type != "gpt2"}
    return path in _paths(swap) and all(holds for words, holds in conditions.items() if words in swap.when)


@pytest.mark.parametrize("path", dp.CANDIDATES)
@pytest.mark.parametrize("config, quantize", [("llama_gqa", None), ("llama_gqa", "int8"), ("gpt2", None)])
def test_the_swap_table_is_what_each_path_swaps(folders, config, path, quantize):
    """Each decode path swaps in exactly the rows of minillm.fast.SWAPS whose ``when`` covers it: on a Llama
    (SwiGLU), quantised or not, and on GPT-2 (a GELU MLP); every fast piece replaces its course piece."""
    pure, fast = _pure_and_fast(folders[config], path, quantize)
    expected = {(_resolve(s.course), _resolve(s.fast)) for s in minillm.fast.SWAPS
                if _applies(s, path, pure, quantize is not None)}
    assert _swapped(pure, fast) == expected
    assert all(issubclass(f, c) for c, f in expected if isinstance(c, type))


def test_every_row_of_the_swap_table_names_its_paths_and_is_in_the_docstring():
    """Each row names at least one decode path; the package docstring's table lists the rows, in order."""
    assert all(_paths(s) for s in minillm.fast.SWAPS)
    lines = [line.split() for line in minillm.fast.__doc__.splitlines()]
    rows = [words[:2] for words in lines if len(words) > 2 and words[1].startswith("fast.")]
    assert rows == [[s.course, s.fast] for s in minillm.fast.SWAPS]


# -- what a user sees --------------------------------------------------------------------------


def test_calibrate_shows_the_cached_choice_or_says_none_was_measured(folder, weights_dir, monkeypatch, capsys):
    import argparse

    from rich.console import Console

    from minillm.cli import main
    from minillm.cli.roofline import _decode_path

    args = argparse.Namespace(model=str(folder), decode_path=False)
    assert _decode_path(args, "float32", Console()) == (
        "not measured (chosen by rule at load; --decode-path measures them all)")
    model = load_model(folder, device="cpu")
    choice = dp.calibrate_decode_path(model, dp.EAGER, measure=FakeTimer(dict.fromkeys(dp.EAGER, 5.0)))
    monkeypatch.setenv("COLUMNS", "400")  # one line, unwrapped
    assert main(["calibrate", "--quick", "--model", str(folder)]) == 0
    assert f"decode path of {folder} on cpu float32: {choice.name} (cached; decode ms/step: " in capsys.readouterr().out


@pytest.mark.parametrize("fast, path", [(True, "row-major+split"), (False, None)])
def test_the_trace_names_the_decode_path(folder, weights_dir, monkeypatch, fast, path):
    from rich.console import Console

    from minillm import SamplingParams, Trace, generate
    from minillm.views.terminal import summary_panel

    monkeypatch.setenv(dp.ENV_VAR, "row-major+split")
    model, trace = load_model(folder, device="cpu", fast=fast), Trace()
    list(generate(model, [1, 2, 3], SamplingParams(max_new_tokens=3), trace=trace, eos_token_ids=[]))
    assert trace.first("model")["decode_path"] == path
    console = Console(record=True, width=200)
    console.print(summary_panel(trace))
    assert ("path        row-major+split  decode path (minillm/fast/choose.py)" in console.export_text()) == fast


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
    assert main(["calibrate", "--quick", "--model", str(folder)]) == 0  # showing the kept path says it too
    out = capsys.readouterr().out
    assert "compile+matvec (cached; decode ms/step: compile+matvec 4.0" in out
    assert "for one-shot commands MINILLM_DECODE_PATH=row-major+split runs the fastest eager path" in out


@pytest.mark.parametrize("path", ["matvec", "long-rows+split"])
def test_converting_a_fast_model_drops_its_stacks_and_keeps_the_pure_models_logits(folder, path):
    """.to(float64) makes new tensors: the stacked products would be float32 and stale; they are dropped."""
    pure = load_model(folder, device="cpu", fast=False).to(torch.float64)
    fast = dp.apply_decode_path(load_model(folder, device="cpu", fast=False), path).to(torch.float64)
    assert fast.blocks[0].attn.qkv is None
    ids = torch.randint(0, pure.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(fast(ids), pure(ids), rtol=0, atol=1e-12)
