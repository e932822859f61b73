"""The replayed decode step (minillm/fast/replay.py): the eager C step's logits and KV cache bit for bit, the
plain lesson model's logits within float rounding, and the eager step wherever it does not apply."""

from __future__ import annotations

import copy
import gc
import types
import weakref

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf
from torch import nn

from minillm import KVCache, decode_step, load_model, prefill
from minillm.fast import choose as dp
from minillm.fast import kernels
from minillm.fast.packing import PackedSwiGLU
from minillm.fast.replay import ReplayedDecodeStep, replay_fits

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C kernels")

FITS = ("llama_gqa", "llama_mqa_tied", "qwen2", "mistral", "llama3_scaling")  # (qwen2: q|k|v biases, its module)
N_STEPS = 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    return {name: save_hf(build_hf(*CONFIGS[name]), root / name) for name in (*FITS, "gpt2", "qwen3")}


def _model(folder, path: str, dtype="float32", quantize=None):
    return dp.apply_decode_path(load_model(folder, device="cpu", fast=False, dtype=dtype, quantize=quantize), path)


def _steps(model, ids: torch.Tensor, n_steps: int = N_STEPS, hook=None):
    """Greedy decode after prefilling ``ids`` [B, T]: each step's logits [n_steps, B, vocab], and the cache."""
    cache = KVCache.for_model(model, batch_size=ids.shape[0], max_seq_len=ids.shape[1] + n_steps)
    token, logits = prefill(model, ids, cache).argmax(-1), []
    for _ in range(n_steps):
        logits.append(decode_step(model, token, cache, hook=hook))
        token = logits[-1].argmax(-1)
    return torch.stack(logits), cache


def _ids(batch: int = 1, length: int = 11) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(7))


class Counting(ReplayedDecodeStep):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __call__(self, model, token_ids, cache):
        self.calls += 1
        return super().__call__(model, token_ids, cache)


@pytest.mark.parametrize("dtype, quantize", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                             ("float32", "int4")])
@pytest.mark.parametrize("config", FITS)
def test_the_replayed_step_is_the_eager_c_step_bit_for_bit(folders, config, dtype, quantize):
    """The same kernels on the same inputs in the same order: logits and the cache's K and V identical."""
    if quantize == "int4" and config in ("qwen2", "mistral"):
        pytest.skip("one int4 model per attention kind is enough")
    eager = _model(folders[config], "matvec", dtype, quantize)
    replayed = _model(folders[config], "replay", dtype, quantize)
    replayed.compiled_decode = step = Counting()
    expected, eager_cache = _steps(eager, _ids())
    logits, cache = _steps(replayed, _ids())
    assert step.calls == N_STEPS and replay_fits(replayed)
    assert torch.equal(logits, expected) and logits.dtype == torch.float32
    assert torch.equal(cache.k, eager_cache.k) and torch.equal(cache.v, eager_cache.v)
    assert cache.length == eager_cache.length


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 0.1)])
def test_the_replayed_step_gives_the_lesson_models_logits(folders, dtype, tolerance):
    """Against the plain PyTorch model (no speed layer): float32 within its rounding; bfloat16 within what the
    kernels' other summation order moves (a few units of bfloat16 in logits of magnitude ~1, over 6 steps)."""
    plain = load_model(folders["llama_gqa"], device="cpu", fast=False, dtype=dtype)
    expected, _ = _steps(plain, _ids())
    logits, _ = _steps(_model(folders["llama_gqa"], "replay", dtype), _ids())
    torch.testing.assert_close(logits, expected, atol=tolerance, rtol=0)


def test_the_rule_replays_where_the_kernels_build(folders, monkeypatch):
    monkeypatch.delenv(dp.ENV_VAR, raising=False)
    monkeypatch.setattr(dp, "load_decode_choice", lambda *args: None)
    for dtype in ("float32", "bfloat16"):
        model = load_model(folders["llama_gqa"], device="cpu", dtype=dtype)
        assert model.decode_path == "replay" and isinstance(model.compiled_decode, ReplayedDecodeStep)


@pytest.mark.parametrize("config", ["gpt2", "qwen3"])
def test_a_model_it_does_not_fit_runs_the_eager_step(folders, config):
    """GPT-2 (LayerNorm, learned positions) and Qwen3 (QK-norm): the eager step, the same logits as matvec's."""
    model = _model(folders[config], "replay")
    model.compiled_decode = step = Counting()
    logits, _ = _steps(model, _ids())
    expected, _ = _steps(_model(folders[config], "matvec"), _ids())
    assert not replay_fits(model) and step.calls == 0 and torch.equal(logits, expected)


def test_a_batch_a_hook_or_a_rolling_cache_runs_the_eager_step(folders):
    model = _model(folders["llama_gqa"], "replay")
    model.compiled_decode = step = Counting()
    batch, _ = _steps(model, _ids(batch=2))
    seen = []
    hooked, _ = _steps(model, _ids(), hook=lambda name, t: seen.append(name))
    rolling = KVCache(model.config.n_layers, 1, model.config.n_kv_heads, 32, model.config.head_dim,
                      rolling_layers=(0,), window=8)
    assert step.calls == 0 and seen
    assert not step.applies(model, rolling)
    with pytest.raises(ValueError, match="^the replayed decode step runs one sequence .*; call minillm.decode_step$"):
        step(model, torch.tensor([[1]]), rolling)
    torch.testing.assert_close(batch, _steps(_model(folders["llama_gqa"], "matvec"), _ids(batch=2))[0], rtol=0,
                               atol=0)
    hooked_eager, _ = _steps(_model(folders["llama_gqa"], "matvec"), _ids(), hook=lambda name, t: None)
    assert torch.equal(hooked, hooked_eager)


def test_the_context_limit_is_the_eager_steps_error(folders):
    model = _model(folders["llama_gqa"], "replay")
    limit = model.config.max_seq_len
    cfg = model.config
    cache = KVCache(cfg.n_layers, 1, cfg.n_kv_heads, limit + 4, cfg.head_dim)  # (for_model would cap it)
    prefill(model, torch.zeros(1, limit, dtype=torch.long), cache)
    assert not model.compiled_decode.applies(model, cache)
    with pytest.raises(ValueError, match=f"^{limit + 1} positions exceed the model's context of {limit}"):
        decode_step(model, 1, cache)


def test_a_replaced_weight_makes_a_new_plan_and_an_edit_in_place_is_read(folders):
    """The plan binds addresses: a parameter replaced (a new tensor) is noticed and the plan made again; a weight
    edited in place is read where it lies. Each step then equals the eager step of the same edited model."""
    replayed, eager = _model(folders["llama_gqa"], "replay"), _model(folders["llama_gqa"], "matvec")
    _steps(replayed, _ids())
    first_plan = replayed.compiled_decode.plan(replayed)
    for model in (replayed, eager):
        with torch.no_grad():
            model.blocks[1].ln2.weight = nn.Parameter(model.blocks[1].ln2.weight * 3, requires_grad=False)
            model.blocks[0].mlp.down_proj.weight.mul_(-2)
            model.lm_head.weight[:5].zero_()
    logits, _ = _steps(replayed, _ids())
    assert replayed.compiled_decode.plan(replayed) is not first_plan
    assert torch.equal(logits, _steps(eager, _ids())[0])


def test_another_thread_count_makes_a_new_plan(folders):
    replayed = _model(folders["llama_gqa"], "replay")
    threads = torch.get_num_threads()
    _steps(replayed, _ids())
    plan = replayed.compiled_decode.plan(replayed)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        logits, _ = _steps(replayed, _ids())
        assert replayed.compiled_decode.plan(replayed) is not plan
        assert torch.equal(logits, _steps(_model(folders["llama_gqa"], "matvec"), _ids())[0])
    finally:
        torch.set_num_threads(threads)


def test_one_step_object_serves_another_model(folders):
    """A step given a second model makes that model's plan: its own logits, not the first model's."""
    step = ReplayedDecodeStep()
    for config in ("llama_gqa", "llama_mqa_tied", "llama_gqa"):
        model = _model(folders[config], "replay")
        model.compiled_decode = step
        assert torch.equal(_steps(model, _ids())[0], _steps(_model(folders[config], "matvec"), _ids())[0])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_replays_its_eager_step(smollm2_dir, dtype):
    """SmolLM2-135M (the shapes the kernels run at), 8 greedy steps after a 40-token prompt: bit for bit."""
    ids = torch.arange(40).view(1, -1) * 7
    eager = dp.apply_decode_path(load_model(smollm2_dir, device="cpu", fast=False, dtype=dtype), "matvec")
    expected, _ = _steps(eager, ids, n_steps=8)
    replayed = dp.apply_decode_path(eager, "replay")
    assert replayed.compiled_decode.applies(replayed, KVCache.for_model(replayed, max_seq_len=64))
    assert torch.equal(_steps(replayed, ids, n_steps=8)[0], expected)


def test_a_copy_of_a_model_that_has_replayed_replays_on_its_own_tensors(folders):
    """copy.deepcopy after a step (a test fixture's habit, a user's experiment) copies no plan (a plan holds
    addresses) but keeps the stacks: the copy replays, the original's logits bit for bit, and zeroing the copy's
    LM head leaves the original's logits alone."""
    model = _model(folders["llama_gqa"], "replay")
    expected, _ = _steps(model, _ids())
    twin = copy.deepcopy(model)
    twin.compiled_decode = step = Counting()
    assert torch.equal(_steps(twin, _ids())[0], expected) and step.calls == N_STEPS
    with torch.no_grad():
        twin.lm_head.weight.zero_()
    assert torch.equal(_steps(model, _ids())[0], expected) and not _steps(twin, _ids())[0].any()


def test_a_step_reuses_its_plan(folders):
    model = _model(folders["llama_gqa"], "replay")
    _steps(model, _ids())
    plan = model.compiled_decode.plan(model)
    _steps(model, _ids())
    assert model.compiled_decode.plan(model) is plan


@pytest.mark.parametrize("where", ["blocks.1.mlp", "blocks.0.attn.o_proj", "lm_head", "global"])
def test_a_forward_hook_runs_the_modules(folders, where):
    """A forward hook (steering, ablation) is PyTorch's promise that a module's output passes through it: the
    replayed step calls no module, so the eager step runs, hook and all (the same logits as matvec's)."""
    def zero(module, args, output):
        calls.append(1)
        return output * 0

    models = {path: _model(folders["llama_gqa"], path) for path in ("replay", "matvec")}
    logits = {}
    for path, model in models.items():
        calls = []
        if where == "global":
            handle = nn.modules.module.register_module_forward_hook(
                lambda m, a, out: zero(m, a, out) if m is model.blocks[1].mlp else None)
        else:
            handle = model.get_submodule(where).register_forward_hook(zero)
        try:
            logits[path], _ = _steps(model, _ids())
        finally:
            handle.remove()
        assert len(calls) == 1 + N_STEPS  # (prefill, then every decode step)
    assert torch.equal(logits["replay"], logits["matvec"])
    assert models["replay"].compiled_decode.applies(models["replay"], KVCache.for_model(models["replay"]))


def test_blocks_in_another_order_attend_over_their_own_layers_cache(folders):
    """Each block reads and writes its own layer's K/V (``attn.layer``), wherever it sits in ``model.blocks``."""
    logits = {}
    for path in ("replay", "matvec"):
        model = _model(folders["llama_gqa"], path)
        model.blocks = nn.ModuleList(reversed(list(model.blocks)))
        logits[path], _ = _steps(model, _ids())
    assert torch.equal(logits["replay"], logits["matvec"])


@pytest.mark.parametrize("change", ["eps", "scale"])
def test_a_norms_eps_or_the_attention_scale_set_after_a_step_is_used(folders, change):
    logits = {}
    for path in ("replay", "matvec"):
        model = _model(folders["llama_gqa"], path)
        cache = KVCache.for_model(model, max_seq_len=20)
        token = prefill(model, _ids(), cache).argmax(-1)
        decode_step(model, token, cache)
        if change == "eps":
            model.blocks[0].ln1.eps = 0.1
        else:
            model.blocks[1].attn.scale = 0.01
        logits[path] = decode_step(model, token, cache)
    assert torch.equal(logits["replay"], logits["matvec"])


class Silenced(PackedSwiGLU):
    def forward(self, x):
        return super().forward(x) * 0.0


@pytest.mark.parametrize("how", ["method", "class"])
@pytest.mark.parametrize("when", ["before the first step", "after a step"])
def test_a_method_set_on_a_module_runs_the_eager_step(folders, when, how):
    """A module's forward replaced on the module itself (``mlp.forward = ...``) or by its class (``mlp.__class__ =
    Subclass``; an ablation without a hook), before the plan is made or after: the replayed step would not call it,
    so the eager step runs (the same logits as matvec's)."""
    def silenced(self, x):
        return PackedSwiGLU.forward(self, x) * 0.0

    logits, counters = {}, {}
    for path in ("replay", "matvec"):
        model = _model(folders["llama_gqa"], path)
        model.compiled_decode = counters[path] = Counting() if path == "replay" else None
        cache = KVCache.for_model(model, max_seq_len=20)
        token = prefill(model, _ids(), cache).argmax(-1)
        if when == "after a step":
            decode_step(model, token, cache)
        mlp = model.blocks[1].mlp
        if how == "method":
            mlp.forward = types.MethodType(silenced, mlp)
        else:
            mlp.__class__ = Silenced
        logits[path] = decode_step(model, token, cache)
    assert torch.equal(logits["replay"], logits["matvec"])
    assert counters["replay"].calls == (1 if when == "after a step" else 0)


def test_a_dropped_cache_is_freed(folders):
    model = _model(folders["llama_gqa"], "replay")
    cache = KVCache.for_model(model, max_seq_len=20)
    decode_step(model, prefill(model, _ids(), cache).argmax(-1), cache)
    dropped = weakref.ref(cache.k)
    del cache
    gc.collect()
    assert dropped() is None


@pytest.mark.parametrize("token", [128, -1, 2.0, [1, 2], "a", None])
def test_a_direct_call_refuses_what_is_not_one_token_id(folders, token):
    model = _model(folders["llama_gqa"], "replay")
    cache = KVCache.for_model(model, max_seq_len=20)
    prefill(model, _ids(), cache)
    with pytest.raises(ValueError, match=r"^the replayed decode step takes one token id in \[0, 128\), got .*; call "
                                         r"minillm.decode_step$"):
        model.compiled_decode(model, token, cache)
    assert cache.length == 11
