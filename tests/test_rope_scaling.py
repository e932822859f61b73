"""RoPE scaling (linear, llama3, yarn, dynamic NTK) against transformers' own tables and models.

The tables: ``inv_freq`` against ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` and cos/sin
against ``LlamaRotaryEmbedding`` at positions 0, 1, 4095, 32767 and beyond the original context,
at a real head_dim of 128, for a float32, a bfloat16 and a float16 model. minillm performs the same float32 operations in the same order as
transformers, on the same torch kernels, so the tightest bound that holds is 0: the tables must be
equal to the bit (a reordered product would show up here as a 1-ulp difference).
Then tiny random-weight Llamas with yarn and with dynamic scaling, logits against transformers.
"""

import pytest
import torch
from tiny_models import LLAMA_BASE, build_hf, save_hf

from minillm import KVCache, ModelConfig, SamplingParams, decode_step, generate, load_model, prefill
from minillm.rope import RotaryEmbedding, rope_attention_factor, rope_inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

TOL = 1e-4
REAL_SHAPE = dict(hidden_size=4096, num_attention_heads=32, num_hidden_layers=1, intermediate_size=64,
                  vocab_size=8)  # head_dim 128; only the rotary tables are built

# name -> (max_position_embeddings, rope_parameters)
VARIANTS = {
    "linear": (4096, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0}),
    "llama3": (131072, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn (Qwen2.5's long-context recipe)": (32768, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                     "original_max_position_embeddings": 32768}),
    "yarn mscale/mscale_all_dim (DeepSeek-style)": (163840, {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}),
    "yarn attention_factor, no truncate, betas": (131072, {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "attention_factor": 1.2, "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0}),
    "dynamic": (4096, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 8.0}),
}
POSITIONS = {"inside the original context": [0, 1, 4095], "beyond it": [0, 1, 4095, 32767, 40000]}


def _configs(name: str):
    max_pos, params = VARIANTS[name]
    hf = transformers.LlamaConfig(**REAL_SHAPE, max_position_embeddings=max_pos, rope_parameters=dict(params))
    ours = ModelConfig.from_hf(dict(REAL_SHAPE, model_type="llama", max_position_embeddings=max_pos,
                                    rope_parameters=dict(params)))
    return hf, ours


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_inv_freq_and_attention_factor_equal_transformers(name):
    hf, ours = _configs(name)
    seq_len = 40000 if ours.rope_scaling.rope_type == "dynamic" else None  # the base grows past 4096
    kwargs = {"seq_len": torch.tensor(seq_len)} if seq_len else {}
    expected, attention_factor = ROPE_INIT_FUNCTIONS[ours.rope_scaling.rope_type](hf, "cpu", **kwargs)
    got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling, seq_len)
    assert got.dtype == torch.float32 and got.shape == (64,)
    assert torch.equal(got, expected)
    assert rope_attention_factor(ours.rope_scaling) == pytest.approx(attention_factor, rel=1e-12)
    plain = rope_inv_freq(ours.head_dim, ours.rope_theta)
    assert (got - plain).abs().max() > 1e-6 * plain.max()  # every variant here changes some frequency


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("where", sorted(POSITIONS))
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cos_sin_equal_transformers(name, where, dtype):
    """In a 16-bit model too: the angles, cos, sin and YaRN's factor in float32, then one cast to the
    model's dtype (a factor applied after the cast would round twice and miss the bit)."""
    hf, ours = _configs(name)
    positions = torch.tensor(POSITIONS[where])
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=dtype), positions[None, :])
    cos, sin = RotaryEmbedding(ours)(positions, dtype)
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_yarn_attention_factor_scales_cos_and_sin():
    """YaRN's factor 0.1·ln(4) + 1 = 1.1386 multiplies the table: cos² + sin² is its square."""
    _, ours = _configs("yarn (Qwen2.5's long-context recipe)")
    cos, sin = RotaryEmbedding(ours)(torch.tensor([7, 70000]), torch.float32)
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, (0.1 * torch.log(torch.tensor(4.0)) + 1) ** 2))


def test_context_lengths_from_the_scaling():
    """yarn: factor · original (4 · 32768); dynamic: factor · max_position_embeddings; llama3: as given."""
    assert [_configs(n)[1].max_seq_len for n in ("yarn (Qwen2.5's long-context recipe)", "dynamic", "llama3")] == [
        131072, 32768, 131072]


# -- whole models: a random-weight Llama with yarn, one with dynamic, against transformers ----------------


def _pair(tmp_path, rope_parameters, max_pos=32, fast=True):
    """(transformers' model, minillm's) on the same weights; ``fast``: the speed layer's modules or the plain ones."""
    hf = build_hf("llama", dict(LLAMA_BASE, max_position_embeddings=max_pos, rope_parameters=rope_parameters))
    return hf, load_model(save_hf(hf, tmp_path), device="cpu", dtype="float32", fast=fast)


def _ids(n, seed=1):
    return torch.randint(0, LLAMA_BASE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _fresh_rotary(hf):
    """transformers' dynamic RoPE module remembers the longest length it has seen: start it afresh."""
    hf.model.rotary_emb = LlamaRotaryEmbedding(hf.config)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_yarn_llama_matches_transformers(tmp_path, impl, fast):
    hf, model = _pair(tmp_path, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32}, fast=fast)
    model.attn_impl = impl
    assert model.config.max_seq_len == 128
    ids = _ids(64)  # twice the original context
    with torch.no_grad():
        expected = hf(ids).logits
        assert (model(ids) - expected).abs().max().item() <= TOL
    cache = KVCache.for_model(model, max_seq_len=64)
    logits = [prefill(model, ids[:, :40], cache)] + [decode_step(model, ids[:, i], cache) for i in range(40, 63)]
    assert (torch.stack(logits, dim=1) - expected[:, 39:-1]).abs().max().item() <= TOL


@pytest.mark.parametrize("fast", [True, False])
def test_dynamic_llama_matches_transformers_with_and_without_cache(tmp_path, fast):
    """Past the original 32 positions the base grows with each pass's length. Without a cache
    every position of a 60-token pass uses the base for 60; through a KV cache each decode step
    uses the base for its own length and cached keys keep theirs, in transformers as in minillm."""
    hf, model = _pair(tmp_path, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, fast=fast)
    assert model.config.max_seq_len == 128
    ids = _ids(60)
    _fresh_rotary(hf)
    with torch.no_grad():
        whole = hf(ids).logits
        assert (model(ids) - whole).abs().max().item() <= TOL

        _fresh_rotary(hf)
        out = hf(ids[:, :24], use_cache=True)  # prefill inside the original context
        hf_steps, past = [out.logits[:, -1]], out.past_key_values
        for i in range(24, 59):  # decode from position 24 to 58, past the original 32
            out = hf(ids[:, i : i + 1], cache=past, use_cache=True)
            hf_steps.append(out.logits[:, -1])
            past = out.past_key_values
    cache = KVCache.for_model(model, max_seq_len=60)
    steps = [prefill(model, ids[:, :24], cache)] + [decode_step(model, ids[:, i], cache) for i in range(24, 59)]
    got, expected = torch.stack(steps, dim=1), torch.stack(hf_steps, dim=1)
    assert (got - expected).abs().max().item() <= TOL
    # The two transformers runs differ past position 32, so the cached comparison can fail:
    assert (expected[:, -1] - whole[:, 58]).abs().max().item() > 1e-3


def test_dynamic_llama_greedy_generate_past_the_original_context(tmp_path):
    hf, model = _pair(tmp_path, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    prompt = _ids(20, seed=3)
    _fresh_rotary(hf)
    with torch.no_grad():
        hf_out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    steps = list(generate(model, prompt[0], SamplingParams(max_new_tokens=32), eos_token_ids=()))
    assert [s.token_id for s in steps] == hf_out[0, 20:].tolist()
    assert steps[-1].cache_length == 20 + 31 > 32


def test_unsupported_rope_type_is_refused_by_name():
    from minillm.errors import ConfigError

    with pytest.raises(ConfigError, match="rope_scaling type 'longrope' is not supported; supported: default, "
                                          "linear, llama3, yarn, dynamic"):
        ModelConfig.from_hf(dict(REAL_SHAPE, model_type="llama", max_position_embeddings=4096,
                                 rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}))


@pytest.mark.compile
def test_compiled_decode_refuses_dynamic_scaling(tmp_path):
    from minillm.fast.compile import compile_decode_step

    _, model = _pair(tmp_path, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ValueError, match="does not support dynamic NTK RoPE scaling"):
        compile_decode_step()(model, 1, KVCache.for_model(model, max_seq_len=8))


def test_serving_engine_refuses_dynamic_scaling(tmp_path):
    from minillm import LLMEngine

    _, model = _pair(tmp_path, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ValueError, match="serving engine does not support dynamic NTK RoPE scaling"):
        LLMEngine(model, num_blocks=8)
