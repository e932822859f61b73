"""bfloat16 prefill attention on pairs of bfloat16s (csrc/attention_bf16.c), on the matrix units and by AVX512-BF16's
dot products: against attention computed in float64 on the same bfloat16 numbers, with the error bound the kernel's
one rounding of the softmax weights allows; the model and the serving engine running it with the plain path's logits
and tokens."""

import pytest
import torch

from tiny_models import CONFIGS, build_hf, save_hf

import minillm
from minillm import KVCache, decode_step, prefill
from minillm.fast import kernels
from minillm.sampling import SamplingParams
from minillm.serving.engine import LLMEngine
from minillm.trace import Trace

pytestmark = pytest.mark.skipif(not (kernels.available() and kernels.bf16_dot_instructions()),
                                reason="needs the C kernels on a CPU with AVX512-BF16")
TILES = [False, pytest.param(True, marks=pytest.mark.skipif(not (kernels.available() and kernels.bf16_amx_ready()),
                                                             reason="needs a CPU with AMX-BF16"))]


def float64_attention(q, k, v):
    """softmax(scale · q·kᵀ + mask) · v in float64, query t of T seeing keys 0 .. S - T + t; GQA by repeating the
    K/V heads. Returns the output and the same weights applied to |v| (for the error bound)."""
    q, k, v = q.double(), k.double(), v.double()
    T, S, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    visible = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + S - T
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return weights @ v, weights @ v.abs()


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 96)])
@pytest.mark.parametrize("T, S", [(1, 1), (5, 5), (16, 16), (17, 40), (31, 31), (33, 100), (130, 130), (100, 257)])
@pytest.mark.parametrize("tiles", TILES)
def test_causal_attention_bf16_is_float64_attention_within_its_rounding(heads, kv_heads, head_dim, T, S, tiles):
    """The softmax weights are rounded to bfloat16 once (2^-8 of each) for their product with v, and the output once:
    |got - want| <= 2^-8 · Σ_j w_j |v_j| + 2^-8 · |want| (+ float32's sums). k and v are a gather's transposed
    views, as a serving chunk hands them."""
    g = torch.Generator().manual_seed(heads * 1000 + T * 10 + S)
    q = (torch.randn(1, T, heads, head_dim, generator=g) * 2).bfloat16().transpose(1, 2)
    k = (torch.randn(1, S, kv_heads, head_dim, generator=g) * 2).bfloat16().transpose(1, 2)
    v = torch.randn(1, S, kv_heads, head_dim, generator=g).bfloat16().transpose(1, 2)
    got = kernels.causal_attention_bf16(q, k, v, head_dim**-0.5, tiles=tiles)
    want, spread = float64_attention(q, k, v)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= 2**-8 * spread + 2**-8 * want.abs() + 1e-5).all()


@pytest.mark.parametrize("tiles", TILES)
def test_causal_attention_bf16_takes_a_batch_and_plain_layouts(tiles):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 20, 64, generator=g).bfloat16()
    k, v = torch.randn(2, 2, 50, 64, generator=g).bfloat16(), torch.randn(2, 2, 50, 64, generator=g).bfloat16()
    got = kernels.causal_attention_bf16(q, k, v, 0.125, tiles=tiles)
    for b in range(2):
        want, spread = float64_attention(q[b:b + 1] * (0.125 * 64**0.5), k[b:b + 1], v[b:b + 1])
        assert ((got[b:b + 1].double() - want).abs() <= 2**-8 * spread + 2**-8 * want.abs() + 1e-5).all()


@pytest.mark.parametrize("change, message", [
    ("float32", "must be bfloat16"), ("head_dim 48", "head_dim must be a multiple of 32"),
    ("T > S", "0 < T <= S"), ("heads not a multiple", "must be a multiple of kv_heads"),
    ("strided head", "must be contiguous"), ("scale a tensor", "scale must be a Python int or float"),
    ("requires grad", "no backward pass")])
def test_causal_attention_bf16_names_the_rule_an_input_breaks(change, message):
    q, k = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    scale = 0.125
    if change == "float32":
        q, k = q.float(), k.float()
    elif change == "head_dim 48":
        q, k = q[..., :48], k[..., :48]
    elif change == "T > S":
        k = k[:, :, :4]
    elif change == "heads not a multiple":
        k = torch.zeros(1, 3, 8, 64, dtype=torch.bfloat16)
    elif change == "strided head":
        q = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)[..., ::2]
    elif change == "scale a tensor":
        scale = torch.tensor(0.125)
    else:
        q.requires_grad_()
    with pytest.raises(ValueError, match=f"{message}.*; use F.scaled_dot_product_attention"):
        kernels.causal_attention_bf16(q, k, k, scale)


def test_causal_attention_bf16_refuses_a_non_tensor_with_a_type_error():
    k = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="causal_attention_bf16 takes tensors, got q NoneType"):
        kernels.causal_attention_bf16(None, k, k, 0.125)


@pytest.fixture(scope="module")
def head_dim_32_model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    model = build_hf(family, dict(kwargs, head_dim=32, max_position_embeddings=256))
    return save_hf(model, tmp_path_factory.mktemp("hd32"))


def test_bfloat16_prefill_runs_on_pairs_with_the_plain_logits(head_dim_32_model, monkeypatch):
    fast = minillm.load_model(head_dim_32_model, dtype=torch.bfloat16)
    plain = minillm.load_model(head_dim_32_model, dtype=torch.bfloat16, fast=False)
    original, calls = kernels.causal_attention_bf16, []
    monkeypatch.setattr(kernels, "causal_attention_bf16", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    ids = torch.arange(80) + 3  # (80 · 80 query-key pairs: enough for the kernel, BF16_MIN_SCORES)
    caches = [KVCache.for_model(model, max_seq_len=96) for model in (fast, plain)]
    logits = [prefill(model, ids, cache).float() for model, cache in zip((fast, plain), caches)]
    assert len(calls) == fast.config.n_layers
    torch.testing.assert_close(logits[0], logits[1], atol=0.05, rtol=2**-7)
    decode_step(fast, logits[0].argmax(-1), caches[0])  # one query: not this kernel's (it packs every key a call)
    assert len(calls) == fast.config.n_layers


def test_serving_chunks_run_on_pairs_with_the_reference_tokens(head_dim_32_model, monkeypatch):
    """Prompts longer than a chunk (their later chunks attend over the pool's earlier blocks): the same greedy tokens
    as the reference engine's gather and SDPA."""
    model = minillm.load_model(head_dim_32_model, dtype=torch.bfloat16)
    original, calls = kernels.causal_attention_bf16, []
    monkeypatch.setattr(kernels, "causal_attention_bf16", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (100, 9, 150)]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    tokens = {}
    for name, paged_batch in (("fast", model.paged_batch), ("reference", None)):
        model.paged_batch = paged_batch
        engine = LLMEngine(model, max_num_seqs=4, kv_cache_memory="8MiB", max_num_batched_tokens=64)
        tokens[name] = [out.token_ids for out in engine.generate(prompts, params)]
    assert calls and tokens["fast"] == tokens["reference"]


def test_the_trace_names_the_kernel(head_dim_32_model):
    """A traced bfloat16 generate: the prefill's attention event says "amx" where it ran on the tiles, else "c" (the
    vector loop), a decode step's its own ("c" where decode's attention runs in C, else "sdpa")."""
    model = minillm.load_model(head_dim_32_model, dtype=torch.bfloat16)
    trace = Trace()
    list(minillm.generate(model, list(range(3, 83)), SamplingParams(temperature=0.0, max_new_tokens=2), trace=trace,
                          eos_token_ids=[]))
    assert trace.prefill["attn_impl"] == ("amx" if kernels.bf16_amx_ready() else "c")
    assert [e["attn_impl"] for e in trace.decode_steps] == ["c" if model.blocks[0].attn.c_decode else "sdpa"]
