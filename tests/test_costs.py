"""The cost model against independent oracles: torch's FlopCounterMode on the real
forward pass, the bytes of the actual parameters and K/V tensors, published
parameter counts, and hand arithmetic."""

import pytest
import torch
from tiny_models import CONFIGS, GPT2_124M, build_hf, save_hf
from torch.utils.flop_counter import FlopCounterMode

from minillm import KVCache, ModelConfig, decode_step, load_model, prefill
from minillm.costs import (
    PhaseCost,
    attention_flops,
    decode_cost,
    flops_per_token,
    kv_bytes_per_token,
    matmul_params,
    prefill_cost,
    weights_bytes,
)
from minillm.model import Transformer
from minillm.whatif import load_config

FAMILIES = ["gpt2", "llama_gqa", "llama_mqa_tied"]
PREFILL_TOKENS, DECODE_CONTEXT = 32, 64


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    """A tiny random model loaded through minillm, eager attention, the lessons' plain PyTorch: every
    matmul is a torch op FlopCounterMode sees (minillm/fast's C products are opaque to it)."""
    family, kwargs = CONFIGS[request.param]
    folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp(request.param))
    return load_model(folder, device="cpu", dtype="float32", attn_impl="eager", fast=False)


def _ids(model, n, seed=0):
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# -- FLOPs vs FlopCounterMode -----------------------------------------------------------


def _masked(config, n_tokens, cached=0):
    """FLOPs eager attention spends on masked-out (future) keys: the rectangle minus the causal part."""
    return attention_flops(config, n_tokens, cached, causal=False) - attention_flops(config, n_tokens, cached)


@pytest.mark.parametrize("cached", [0, 16])
def test_prefill_flops_match_flop_counter(model, cached):
    """Exact, once the masked half of eager attention is added. (Not within 5% without it on
    these 64-wide toys: for the MQA one the masked half is 5.1% of all FLOPs; see the
    real-shape test below.)"""
    cache = KVCache.for_model(model, max_seq_len=128)
    if cached:
        prefill(model, _ids(model, cached, seed=1), cache)
    counted = _counted(lambda: prefill(model, _ids(model, PREFILL_TOKENS), cache))
    cost = prefill_cost(model.config, PREFILL_TOKENS, 4, cached_tokens=cached)
    assert cost.flops + _masked(model.config, PREFILL_TOKENS, cached) == counted


def test_decode_flops_match_flop_counter(model):
    cache = KVCache.for_model(model, max_seq_len=128)
    prefill(model, _ids(model, DECODE_CONTEXT - 1), cache)
    counted = _counted(lambda: decode_step(model, 5, cache))
    assert cache.length == DECODE_CONTEXT
    assert decode_cost(model.config, DECODE_CONTEXT, 4).flops == counted
    assert flops_per_token(model.config, DECODE_CONTEXT) == counted


def _real_shape(name: str) -> ModelConfig:
    if name == "gpt2-124m":
        return ModelConfig.from_hf(dict(GPT2_124M[1], model_type="gpt2"))
    return load_config(name)


@pytest.mark.parametrize("name", ["gpt2-124m", "llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-0.5b", "qwen3-0.6b"])
def test_flops_within_5_percent_on_real_shapes(name):
    """Real model shapes on the meta device (no memory, no arithmetic; FlopCounterMode
    still sees every matmul's shape): prefill 32 tokens, then one decode step at context 64."""
    config = _real_shape(name)
    with torch.device("meta"):
        model = Transformer(config, attn_impl="eager").to("meta", torch.bfloat16)
        cache = KVCache(config.n_layers, 1, config.n_kv_heads, 128, config.head_dim, torch.bfloat16, "meta")
        prompt, cached = torch.zeros(1, PREFILL_TOKENS, dtype=torch.long), torch.zeros(1, 31, dtype=torch.long)
        token = torch.zeros(1, 1, dtype=torch.long)
    with torch.inference_mode():
        counted_prefill = _counted(lambda: model(prompt, cache=cache, last_only=True))
        model(cached, cache=cache, last_only=True)  # cache now holds 63 positions
        counted_decode = _counted(lambda: model(token, cache=cache))
    cost = prefill_cost(config, PREFILL_TOKENS, 2)
    assert abs(cost.flops - counted_prefill) / counted_prefill < 0.05
    assert cost.flops + _masked(config, PREFILL_TOKENS) == counted_prefill
    assert decode_cost(config, DECODE_CONTEXT, 2).flops == counted_decode


def test_prefill_without_last_only_counts_every_lm_head_row(model):
    cache = KVCache.for_model(model, max_seq_len=128)
    ids = _ids(model, PREFILL_TOKENS).reshape(1, -1)
    with torch.inference_mode():
        counted = _counted(lambda: model(ids, cache=cache))
    cost = prefill_cost(model.config, PREFILL_TOKENS, 4, last_only=False)
    assert cost.flops + _masked(model.config, PREFILL_TOKENS) == counted


# -- bytes vs the real tensors -----------------------------------------------------------


def test_decode_bytes_are_weights_plus_the_kv_attention_touches(model):
    cache = KVCache.for_model(model, max_seq_len=128)
    prefill(model, _ids(model, DECODE_CONTEXT - 1), cache)
    seen = {"read": 0, "written": 0}

    def hook(name, t):  # the K/V tensors attention reads (whole cache) and the new ones it writes
        if name.endswith(("hook_k_cache", "hook_v_cache")):
            seen["read"] += t.nbytes
        elif name.endswith(("attn.hook_k", "attn.hook_v")):
            seen["written"] += t.nbytes

    decode_step(model, 5, cache, hook=hook)
    cost = decode_cost(model.config, cache.length, 4)
    assert cost.weights_bytes == model.weights_bytes()
    assert cost.kv_read_bytes == seen["read"] == cache.bytes_per_token * cache.length
    assert cost.kv_written_bytes == seen["written"] == cache.bytes_per_token
    assert cost.bytes == model.weights_bytes() + cache.bytes_per_token * (cache.length + 1)


def test_prefill_bytes_onto_a_cached_prefix(model):
    cache = KVCache.for_model(model, max_seq_len=128)
    prefill(model, _ids(model, 10), cache)
    cost = prefill_cost(model.config, 20, 4, cached_tokens=10)
    assert cost.bytes == model.weights_bytes() + cache.bytes_per_token * (30 + 20)


def test_decode_is_a_one_token_prefill():
    config = load_config("llama-3-8b")
    assert decode_cost(config, 100, 2, batch_size=3) == prefill_cost(config, 1, 2, cached_tokens=99, batch_size=3)


def test_batch_reads_weights_once_and_kv_per_sequence():
    config = load_config("llama-3-8b")
    one, four = decode_cost(config, 100, 2), decode_cost(config, 100, 2, batch_size=4)
    assert four.flops == 4 * one.flops
    assert four.weights_bytes == one.weights_bytes
    assert four.kv_read_bytes == 4 * one.kv_read_bytes


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weights_bytes_from_config_equal_the_loaded_model(name, tmp_path):
    family, kwargs = CONFIGS[name]
    model = load_model(save_hf(build_hf(family, kwargs), tmp_path), device="cpu", dtype="float32")
    assert weights_bytes(model.config, 4) == model.weights_bytes()


LLAMA_BIASES = ("llama", dict(CONFIGS["llama_gqa"][1], attention_bias=True, mlp_bias=True))


@pytest.mark.parametrize("family_kwargs", [GPT2_124M, CONFIGS["gpt2"], LLAMA_BIASES],
                         ids=["gpt2-124m", "gpt2", "llama-biases"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_bytes_gpt2_biases_and_untied_variants(family_kwargs, tied, dtype):
    """Meta-device models: the parameter shapes without allocating them."""
    family, kwargs = family_kwargs
    config = ModelConfig.from_hf(dict(kwargs, model_type=family, tie_word_embeddings=tied))
    with torch.device("meta"):
        model = Transformer(config).to(dtype)
    assert weights_bytes(config, dtype.itemsize) == model.weights_bytes()


# -- hand computations -------------------------------------------------------------------


def test_published_parameter_counts():
    gpt2 = ModelConfig.from_hf(dict(GPT2_124M[1], model_type="gpt2"))
    assert weights_bytes(gpt2, 1) == 124_439_808  # HF gpt2
    assert weights_bytes(load_config("llama-2-7b"), 1) == 6_738_415_616  # Llama-2-7b-hf
    assert weights_bytes(load_config("llama-3-8b"), 1) == 8_030_261_248  # Meta-Llama-3-8B


def test_kv_bytes_per_token_by_hand():
    assert kv_bytes_per_token(load_config("llama-2-7b"), 2) == 2 * 32 * 32 * 128 * 2 == 524_288
    assert kv_bytes_per_token(load_config("llama-3-8b"), 2) == 2 * 32 * 8 * 128 * 2 == 131_072


def test_matmul_params_and_flops_by_hand():
    config = load_config("llama-3-8b")
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q, o; k, v (8 KV heads); SwiGLU
    assert matmul_params(config) == 32 * per_layer + 4096 * 128256
    assert flops_per_token(config, 1000) == 2 * matmul_params(config) + 4 * 32 * 32 * 128 * 1000


def test_causal_attention_pairs_by_hand():
    config = load_config("llama-2-7b")
    unit = 4 * 32 * 32 * 128  # FLOPs per query-key pair, all layers
    assert attention_flops(config, 3) == unit * (1 + 2 + 3)
    assert attention_flops(config, 2, cached_tokens=5) == unit * (6 + 7)
    assert attention_flops(config, 2, cached_tokens=5, causal=False) == unit * 2 * 7


def test_arithmetic_intensity():
    assert PhaseCost(flops=600.0, bytes=200.0).arithmetic_intensity == 3.0
    decode = decode_cost(load_config("llama-3-8b"), 1, 2)
    assert decode.arithmetic_intensity == pytest.approx(1.0, rel=0.1)  # ≈ 2 FLOP per 2-byte weight


@pytest.mark.parametrize("kwargs", [dict(n_tokens=0), dict(n_tokens=1, cached_tokens=-1),
                                    dict(n_tokens=1, batch_size=0)])
def test_bad_shapes_raise(kwargs):
    with pytest.raises(ValueError):
        prefill_cost(load_config("llama-3-8b"), dtype_bytes=2, **kwargs)
