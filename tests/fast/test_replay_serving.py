"""The replayed serving step (minillm/fast/replay_serving.py): each decode-only step's logits and the pool the eager
forward's bit for bit, through an engine whose batch grows and shrinks, and the eager forward wherever it does not
apply."""

from __future__ import annotations

import copy
import random
import types

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

import minillm.serving.engine as engine_module
from minillm import LLMEngine, SamplingParams, load_model
from minillm.fast import choose as dp
from minillm.fast import kernels
from minillm.fast.packing import PackedSwiGLU
from minillm.fast.replay_serving import ReplayedServingStep
from minillm.serving import model_runner
from minillm.serving.paged_attention import PagedBatch, forward_batch

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C kernels")

FITS = ("llama_gqa", "llama_mqa_tied", "qwen2", "llama3_scaling")  # (qwen2: q|k|v biases, its module)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay_serving")
    return {name: save_hf(build_hf(*CONFIGS[name]), root / name) for name in (*FITS, "gpt2")}


def _model(folder, dtype="float32", quantize=None, path="replay"):
    return dp.apply_decode_path(load_model(folder, device="cpu", fast=False, dtype=dtype, quantize=quantize), path)


class Checked(ReplayedServingStep):
    """Runs the replay, then the eager forward on the pool as it was before, and asserts both bit for bit."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __call__(self, model, batch):
        cache = batch.cache
        before = cache.k.clone(), cache.v.clone()
        logits = super().__call__(model, batch)
        after = cache.k.clone(), cache.v.clone()
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        expected = forward_batch(model, batch)
        assert torch.equal(logits, expected), f"logits differ by up to {(logits - expected).abs().max()}"
        assert torch.equal(after[0], cache.k) and torch.equal(after[1], cache.v), "the pool differs"
        self.rows.append(len(batch.token_ids))
        return logits


def _serve(model, n_requests: int = 7, max_new: int = 9, seed: int = 0, max_num_seqs: int = 8,
           kv_cache_memory=2**20) -> dict:
    """Greedy requests of prompts 2-40 tokens and outputs 1-max_new tokens, half at the first step and half at the
    fifth (batches of decodes that grow, then shrink as requests finish): request id -> its output tokens."""
    rng = random.Random(seed)
    engine = LLMEngine(model, max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory, block_size=4)
    vocab, ids = model.config.vocab_size, []
    for step in range(200):
        if step in (0, 4):
            for _ in range(n_requests // 2 if step == 0 else n_requests - n_requests // 2):
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 40))]
                params = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, max_new), ignore_eos=True)
                ids.append(engine.add_request(prompt, params))
        elif not engine.has_unfinished_requests():
            break
        engine.step()
    return {rid: list(engine.requests[rid].output_ids) for rid in ids}


@pytest.mark.parametrize("dtype, quantize", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                             ("float32", "int4")])
@pytest.mark.parametrize("config", FITS)
def test_each_decode_step_is_the_eager_forward_bit_for_bit(folders, config, dtype, quantize):
    """Batches of 1-12 decodes as requests come and go: logits and the pool identical to forward_batch's."""
    if quantize == "int4" and config == "qwen2":
        pytest.skip("one int4 model per attention kind is enough")
    model = _model(folders[config], dtype, quantize)
    model.replayed_batch = step = Checked()
    _serve(model, n_requests=12, max_new=12, max_num_seqs=12)
    # several batch sizes, each its own plan; from 9 rows bfloat16 products take bf16_rows_matmul
    assert len(set(step.rows)) >= 3 and max(step.rows) >= 9, step.rows


def test_the_tokens_are_the_eager_engines(folders):
    """The same requests through an engine on the eager step (the "matvec" path) give the same tokens."""
    replayed, eager = _model(folders["llama_gqa"]), _model(folders["llama_gqa"], path="matvec")
    assert isinstance(replayed.replayed_batch, ReplayedServingStep) and eager.replayed_batch is None
    assert _serve(replayed, seed=3) == _serve(eager, seed=3)


def test_a_batch_larger_than_the_buffers_plans_again(folders):
    """The buffers are sized for the largest batch met (a power of two): a larger one replaces them and every plan."""
    model = _model(folders["llama_gqa"])
    model.replayed_batch = step = Checked()
    _serve(model, n_requests=3, max_num_seqs=3)
    assert step._scratch.capacity == 4
    _serve(model, n_requests=12, max_new=12, max_num_seqs=12, seed=1)
    assert step._scratch.capacity == 16 and max(step.rows) > 4


def test_a_changed_model_is_planned_again(folders):
    """A module replaced between steps (here a norm's weight and the attention's scale): the next step's plan is
    made from the model as it is, still the eager forward's values (whose fast batch reads the scale at each step)."""
    model = _model(folders["llama_gqa"])
    model.replayed_batch = step = Checked()
    _serve(model, n_requests=3)
    block = model.blocks[0]
    block.ln2.weight = torch.nn.Parameter(block.ln2.weight * 1.5, requires_grad=False)
    block.attn.scale = 0.2
    _serve(model, n_requests=3, seed=2)
    assert step.rows


def test_an_attention_scale_set_after_loading_is_used(folders):
    """The score scale set on each attention after loading: the replayed steps, the fast batch's eager forward and
    the lesson's model (``fast=False``) give the same greedy tokens (the fast batch read the scales once at load)."""
    models = {"replay": _model(folders["llama_gqa"]), "eager": _model(folders["llama_gqa"]),
              "lesson": load_model(folders["llama_gqa"], device="cpu", fast=False)}
    models["eager"].replayed_batch = None
    for model in models.values():
        for block in model.blocks:
            block.attn.scale = 0.9
    tokens = {name: _serve(model, seed=5) for name, model in models.items()}
    assert tokens["replay"] == tokens["eager"] == tokens["lesson"]
    assert tokens["replay"] != _serve(_model(folders["llama_gqa"]), seed=5)  # (the scale changed the answer)


@pytest.mark.parametrize("case", ["hook", "global hook", "reference batch", "gpt2", "sliding window", "no path"])
def test_the_eager_forward_runs_where_the_replay_does_not_apply(folders, monkeypatch, case):
    """A forward hook (a module's, or torch's global one), the reference PagedBatch (``--no-fast``), a model the
    replay does not fit (GPT-2, a layer with a sliding window) or another decode path: never replayed, the same
    tokens as the eager engine's."""
    config = "gpt2" if case == "gpt2" else "llama_gqa"
    model, eager = _model(folders[config], path="matvec" if case == "no path" else "replay"), _model(folders[config],
                                                                                                   path="matvec")
    if case == "sliding window":
        for m in (model, eager):
            m.blocks[0].attn.window = 3
    expected, calls = _serve(eager, seed=4), []
    if model.replayed_batch is not None:
        model.replayed_batch = step = Checked()
        monkeypatch.setattr(step, "_plan", lambda *a: calls.append(a) or ReplayedServingStep._plan(step, *a))
    if case == "hook":
        model.blocks[1].mlp.register_forward_hook(lambda *args: None)
    elif case == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    elif case == "reference batch":
        model.paged_batch = None
    try:
        assert _serve(model, seed=4) == expected
    finally:
        if case == "global hook":
            handle.remove()
    assert calls == []


@pytest.mark.parametrize("how", ["method", "class"])
def test_a_forward_replaced_on_a_module_is_served(folders, how):
    """An MLP's forward replaced on the module or by a subclass (an ablation): the steps after it run the eager
    forward, which calls it; the tokens are the eager engine's with the same change, not the unchanged model's."""
    def doubled(self, x):
        return PackedSwiGLU.forward(self, x) * 2.0

    Doubled = type("Doubled", (PackedSwiGLU,), {"forward": doubled})

    served = {}
    for path in ("replay", "matvec"):
        model = _model(folders["llama_gqa"], path=path)
        mlp = model.blocks[0].mlp
        if how == "method":
            mlp.forward = types.MethodType(doubled, mlp)
        else:
            mlp.__class__ = Doubled
        served[path] = _serve(model, seed=6)
    assert served["replay"] == served["matvec"] != _serve(_model(folders["llama_gqa"]), seed=6)


def test_a_prefill_chunk_in_the_step_runs_the_eager_forward(folders, monkeypatch):
    """A step with a prefill chunk beside its decodes is not replayed; the decode-only steps are."""
    model = _model(folders["llama_gqa"])
    model.replayed_batch = step = Checked()
    kinds = []

    def recording(model, cache, scheduled):
        kinds.append(any(n > 1 for n in scheduled.num_tokens))
        return model_runner.run_model(model, cache, scheduled)

    monkeypatch.setattr(engine_module, "run_model", recording)
    _serve(model)
    assert len(step.rows) == kinds.count(False) and kinds.count(True) > 0


def test_a_direct_call_on_a_batch_it_does_not_take_says_so(folders):
    """A reference PagedBatch (or not a batch at all) given straight to the step: one line naming what to call."""
    model = _model(folders["llama_gqa"])
    engine = LLMEngine(model, max_num_seqs=2, kv_cache_memory=2**20, block_size=4)
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3))
    scheduled = engine.scheduler.schedule()
    batch, _ = model_runner.prepare_batch(engine.cache, scheduled, PagedBatch)
    for wrong in (batch, None, "batch"):
        with pytest.raises(ValueError, match=r"^the replayed serving step runs a fast batch of decodes .*batch$"):
            model.replayed_batch(model, wrong)


def test_a_copied_model_plans_for_itself(folders):
    """A deepcopy carries no plan (its addresses would be the original's): the copy's steps are its own, still the
    eager forward's values."""
    model = _model(folders["llama_gqa"])
    _serve(model, n_requests=3)
    twin = copy.deepcopy(model)
    assert twin.replayed_batch._plans == {} and twin.replayed_batch._scratch is None
    twin.replayed_batch = step = Checked()
    _serve(twin, n_requests=3)
    assert step.rows


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_decode_steps_are_the_eager_forwards(dtype):
    """SmolLM2-135M: its real shapes (GQA 9/3, head_dim 64, 30 layers) at batches of up to 16 decodes."""
    model = load_model("smollm2-135m-instruct", device="cpu", dtype=dtype)
    model.replayed_batch = step = Checked()
    _serve(model, n_requests=16, max_new=12, max_num_seqs=16, kv_cache_memory="64MiB")
    assert max(step.rows) >= 9
