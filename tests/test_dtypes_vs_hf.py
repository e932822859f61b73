"""minillm's modules and logits in bfloat16 and float16 against transformers' own, with tolerances that have teeth.

Every other comparison with transformers runs in float32, where a norm computed in the model's dtype instead
of float32 passes unseen. Here each module (RMSNorm, GPT-2's LayerNorm, RoPE, attention eager and SDPA,
with a causal mask and through the KV cache, the MLPs) runs in the 16-bit format against transformers'
module of the same checkpoint on the same input, the lesson's modules and the speed layer's (``fast=True``).

The measure: e(got, expected) = ‖got − expected‖₂ / ‖expected‖₂ over the whole output, in float64, in
units of the format's unit roundoff u, the largest relative error of one rounding to nearest:
u = 2^-8 ≈ 3.9e-3 for bfloat16 (8 significant bits), 2^-11 ≈ 4.9e-4 for float16 (11).

The tolerance, module by module: e ≤ u/2. Why that number, and why the op's depth does not raise it:

- One rounding of outputs spread over a binade costs about 0.42u normwise (measured: a float32-accumulated
  product rounded once to bfloat16, against float64). So an implementation that rounds to the 16-bit format
  at one more, one fewer or one other point than transformers lands about that far away or more: the wrong
  variants below measure 0.64u-1.13u in bfloat16 and 0.74u-1.07u in float16 on ordinary inputs, 1.5u-2u
  for attention with RoPE frequencies rounded to 16 bits, 80u-540u for RoPE tables taken in 16 bits, and
  ~900u for float16 norms on massive activations (x² overflows).
- minillm rounds at transformers' points (RMSNorm: x/rms once, the weight product once; RoPE: cos and sin
  once, from float32 angles; attention: the projections, q·kᵀ, its scale, the float32 softmax's output,
  p·v; the MLP: each product and activation once). Between two cast points everything is float32 (PyTorch's
  CPU products, softmax and fused activations accumulate in float32), so a module's depth adds only float32
  summation order, which rarely moves a 16-bit result across a rounding boundary: the speed layer's
  column-major products differ from row-major ones by 0.005u (SmolLM2's shapes, 32 rows). All 126
  like-for-like module comparisons here measure 0 (bitwise), the lesson's modules and the speed layer's,
  but the speed layer's bfloat16 decode steps through the KV cache: its attention in C rounds the softmax's
  numerators to bfloat16 before p·v, where SDPA's CPU kernel does, from another exp (so a few of them round
  the other way): up to 0.47u (the developers' AMD EPYC; float32 throughout, one rounding fewer, was 0.9u).
- u/2 sits between the two: 100x above a different summation order, 1.3x-2x below one moved cast
  point. The same u/2 serves both formats (float16's u is 8x smaller: its bound is 8x tighter).
- Depth matters where rounding differences compound: over a real model's 30 layers a one-bit difference
  grows to the size of bfloat16's own error, so the SmolLM2 logits test takes its tolerance from
  bfloat16's measured error against float32 instead.

Each group of checks ends with the classic dtype bugs run through the same comparison, asserted rejected:
a norm in the model's dtype, RoPE's angles or frequencies in the model's dtype, an activation written out
in the model's dtype. One classic GPU bug has no CPU counterpart: a softmax called on bfloat16 scores
computes in float32 inside PyTorch's CPU kernel, bit for bit what ``softmax(scores.float())`` gives.
"""

import copy
import math

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, decode_step, load_model, load_tokenizer, prefill
from minillm.model import RMSNorm
from minillm.rope import apply_rope

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
TOL_U = 0.5  # like for like, in units of u: below the 0.64u-1.13u of one moved cast point (module docstring)
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
FAMILIES = ("llama_gqa", "qwen2", "qwen3", "mistral", "gpt2")  # tests/tiny_models.py: GQA, biases, QK-norm, GPT-2
ROPE_CONFIGS = ("llama_gqa", "qwen3", "llama3_scaling")  # head_dim 16, head_dim 24, Llama 3.1's scaling
POSITIONS = torch.arange(1000, 1024)  # a long conversation's suffix: where RoPE's precision matters


def error_in_u(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """‖got − expected‖₂ / ‖expected‖₂ in float64, in units of the unit roundoff u of ``dtype`` (default: got's)."""
    got64, ref = got.double(), expected.double()
    return ((got64 - ref).norm() / ref.norm()).item() / UNIT_ROUNDOFF[dtype or got.dtype]


def assert_same_arithmetic(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    e = error_in_u(got, expected)
    assert e <= TOL_U, f"{what}: {e:.3f}u from transformers' (tolerance {TOL_U}u, u of {expected.dtype})"


def assert_rejected(wrong: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    e = error_in_u(wrong, expected)
    assert e > TOL_U, f"the wrong variant {what!r} passes: {e:.3f}u <= {TOL_U}u: the tolerance has no teeth"


def residual_stream(shape, dtype, seed=0) -> torch.Tensor:
    """Hidden states as a norm meets them: N(0, 1), plus a few massive activations (hundreds, as the
    residual streams of real LLMs carry; Sun et al. 2024, arXiv:2402.17762) on channel 3 of some tokens."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., ::5, 3] = 300.0
    return x.to(dtype)


def hidden(shape, dtype, seed=1) -> torch.Tensor:
    """A normalised layer input (what attention and the MLP read): N(0, 1) in ``dtype``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(name, dtype, impl="eager", fast=False, fused_gelu=True) -> (transformers' model, minillm's): one
    tests/tiny_models.py config in ``dtype``, both with attention ``impl``, built and loaded once.

    transformers' is loaded as users load it (``from_pretrained(dtype=...)`` keeps RoPE's frequencies in
    float32). Its GPT-2 runs "gelu_pytorch_tanh" (F.gelu's tanh approximation, as minillm's) unless
    ``fused_gelu`` is False: the checkpoint's own "gelu_new" is the same function written out in 16-bit
    steps (:func:`test_gpt2_mlp_is_at_least_as_accurate_as_gelu_new`)."""
    folders, made = {}, {}

    def get(name, dtype, impl="eager", fast=False, fused_gelu=True):
        family, kwargs = CONFIGS[name]
        if name not in folders:
            folders[name] = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp(name))
        key = (name, dtype, impl, fast, fused_gelu)
        if key not in made:
            gelu = {"activation_function": "gelu_pytorch_tanh"} if fused_gelu and family == "gpt2" else {}
            hf = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=dtype,
                                                                   attn_implementation=impl, **gelu).eval()
            made[key] = hf, load_model(folders[name], device="cpu", dtype=dtype, fast=fast, attn_impl=impl)
        return made[key]

    return get


def hf_layer(hf):
    return hf.transformer.h[0] if hf.config.model_type == "gpt2" else hf.model.layers[0]


def hf_norms(hf) -> dict:
    """transformers' norms by minillm's names: the first layer's two and the final one."""
    if hf.config.model_type == "gpt2":
        return {"ln1": hf.transformer.h[0].ln_1, "ln2": hf.transformer.h[0].ln_2, "ln_final": hf.transformer.ln_f}
    layer = hf.model.layers[0]
    return {"ln1": layer.input_layernorm, "ln2": layer.post_attention_layernorm, "ln_final": hf.model.norm}


def our_norms(model) -> dict:
    return {"ln1": model.blocks[0].ln1, "ln2": model.blocks[0].ln2, "ln_final": model.ln_final}


# -- norms ---------------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("name", FAMILIES)
def test_norms_match_transformers(models, name, dtype):
    """RMSNorm (LlamaRMSNorm: the variance in float32, x/rms cast back, then the weight) and GPT-2's
    LayerNorm, on hidden states with massive activations."""
    hf, ours = models(name, dtype)
    x = residual_stream((4, 40, ours.config.d_model), dtype)
    with torch.no_grad():
        for part, theirs in hf_norms(hf).items():
            assert_same_arithmetic(our_norms(ours)[part](x), theirs(x), f"{name} {part}")


def rms_norm_in_dtype(norm, x):
    """The classic bug: RMSNorm computed in the model's dtype (the mean of squares rounded, then rsqrt)."""
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


def rms_norm_weight_in_float32(norm, x):
    """Gemma's order, not Llama's: the weight product in float32 and one rounding at the end."""
    x32 = x.float()
    return (norm.weight.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


def layer_norm_in_dtype(norm, x):
    """GPT-2's LayerNorm written out in the model's dtype: the mean subtracted and the variance taken in 16 bits."""
    centred = x - x.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias


@DTYPES
@pytest.mark.parametrize("name, wrong", [("llama_gqa", rms_norm_in_dtype), ("llama_gqa", rms_norm_weight_in_float32),
                                         ("gpt2", layer_norm_in_dtype)],
                         ids=["rmsnorm in dtype", "rmsnorm weight in float32", "layernorm in dtype"])
@pytest.mark.parametrize("scale", ["ordinary", "massive"])
def test_norms_in_the_wrong_precision_are_rejected(models, name, wrong, dtype, scale):
    """The same comparison rejects each wrong norm, on ordinary hidden states (N(0, 1): 0.69u-1.06u, the cost
    of one moved cast point) and on hidden states with massive activations (bfloat16: 0.64u-1.13u; float16:
    ~900u, x² overflows past 256)."""
    hf, ours = models(name, dtype)
    shape = (4, 40, ours.config.d_model)
    x = residual_stream(shape, dtype) if scale == "massive" else hidden(shape, dtype)
    with torch.no_grad():
        assert_rejected(wrong(ours.blocks[0].ln1, x), hf_norms(hf)["ln1"](x), wrong.__name__)


# -- RoPE ----------------------------------------------------------------------------------------------

ROPE_POSITIONS = torch.cat((torch.arange(0, 64), torch.arange(1000, 1064), torch.arange(8000, 8064)))


def hf_cos_sin(hf, positions, dtype):
    """transformers' tables: LlamaRotaryEmbedding's float32 angles, cos and sin cast to the input's dtype."""
    x = torch.zeros(1, dtype=dtype)
    cos, sin = hf.model.rotary_emb(x, positions[None])
    return cos[0], sin[0]


@DTYPES
@pytest.mark.parametrize("name", ROPE_CONFIGS)
def test_rope_tables_and_rotation_match_transformers(models, name, dtype):
    """cos and sin at positions 0-63, 1000-1063 and 8000-8063, and q, k rotated by them
    (transformers' apply_rotary_pos_emb), in the 16-bit format."""
    hf, ours = models(name, dtype)
    cos, sin = ours.rope(ROPE_POSITIONS, dtype)
    hf_cos, hf_sin = hf_cos_sin(hf, ROPE_POSITIONS, dtype)
    assert_same_arithmetic(cos, hf_cos, f"{name} cos")
    assert_same_arithmetic(sin, hf_sin, f"{name} sin")
    T, D = len(ROPE_POSITIONS), ours.config.head_dim
    q, k = hidden((2, 4, T, D), dtype, seed=2), hidden((2, 2, T, D), dtype, seed=3)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos[None], hf_sin[None])
    assert_same_arithmetic(apply_rope(q, cos, sin), hf_q, f"{name} rotated q")
    assert_same_arithmetic(apply_rope(k, cos, sin), hf_k, f"{name} rotated k")


def angles_in_dtype(rope, positions, dtype):
    """The classic bug: positions · inv_freq computed in the model's dtype (bfloat16 holds integers
    exactly only up to 256: position 1001 is stored as 1000)."""
    angles = positions.to(dtype)[:, None] * rope.inv_freq.to(dtype)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def inv_freq_in_dtype(rope, positions, dtype):
    """inv_freq rounded to the model's dtype (what ``model.to(torch.bfloat16)`` does to a float buffer), the
    angles then taken in float32: each frequency off by up to u of itself, position p's angle by up to
    p·inv_freq·u."""
    angles = positions.float()[:, None] * rope.inv_freq.to(dtype).float()[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@DTYPES
@pytest.mark.parametrize("wrong", [angles_in_dtype, inv_freq_in_dtype])
def test_rope_in_the_wrong_precision_is_rejected(models, wrong, dtype):
    hf, ours = models("llama_gqa", dtype)
    cos, sin = wrong(ours.rope, ROPE_POSITIONS, dtype)
    hf_cos, hf_sin = hf_cos_sin(hf, ROPE_POSITIONS, dtype)
    assert_rejected(cos, hf_cos, f"{wrong.__name__} (cos)")
    assert_rejected(sin, hf_sin, f"{wrong.__name__} (sin)")


@DTYPES
def test_a_model_cast_by_to_keeps_rope_in_float32(models, dtype):
    """``model.to(torch.bfloat16)``, PyTorch's idiom for a dtype change, gives ``load_model(dtype=...)``'s
    logits and transformers' RoPE tables: ``nn.Module.to`` rounds every float buffer, and RoPE's frequencies
    rounded to 16 bits turn position p off by up to p·inv_freq·u radians (bfloat16, inv_freq 0.32, p = 1000:
    up to 1.2 rad). Before minillm kept them float32 (RotaryEmbedding._apply) the tables measured 82u-255u
    from transformers' here and the logits 1.2u from load_model's."""
    hf, loaded = models("llama_gqa", dtype)
    cast = load_model(loaded.source, device="cpu", dtype=torch.float32, fast=False, attn_impl="eager").to(dtype)
    assert cast.rope.inv_freq.dtype == torch.float32
    cos, sin = cast.rope(ROPE_POSITIONS, dtype)
    hf_cos, hf_sin = hf_cos_sin(hf, ROPE_POSITIONS, dtype)
    assert_same_arithmetic(cos, hf_cos, "cos")
    assert_same_arithmetic(sin, hf_sin, "sin")
    ids = torch.randint(0, 128, (1, loaded.config.max_seq_len), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(cast(ids), loaded(ids))


# -- attention -----------------------------------------------------------------------------------------


def hf_attention(hf, x, positions, cache=None):
    """transformers' first attention layer on x [B, T, d_model] at ``positions``: causal (eager: the
    additive mask transformers builds, the dtype's minimum above the diagonal; SDPA: is_causal)."""
    layer, T = hf_layer(hf), x.shape[1]
    eager_mask = None
    if hf.config._attn_implementation == "eager" and T > 1:
        eager_mask = torch.full((T, T), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
    if hf.config.model_type == "gpt2":
        return layer.attn(x, cache=cache, attention_mask=eager_mask)[0]
    return layer.self_attn(x, position_embeddings=hf.model.rotary_emb(x, positions[None]),
                           attention_mask=eager_mask, cache=cache)[0]


def our_attention(model, x, positions, cache=None, tables=None):
    """minillm's first attention layer on x at ``positions``; ``tables(rope, positions, dtype)`` replaces
    the model's cos/sin (a wrong variant)."""
    tables = tables or (lambda rope, p, dtype: rope(p, dtype))
    cos_sin = tables(model.rope, positions, x.dtype) if model.rope is not None else None
    out = model.blocks[0].attn(x, cos_sin, cache, model.attn_impl, None)
    if cache is not None:
        cache.advance(x.shape[1])
    return out


def attention_input(model, dtype) -> torch.Tensor:
    """x [2, 24, d_model] for the first attention layer: N(0, 8²), so that the tiny random q and k weights give
    scores q·k/√head_dim of a few units, as trained models have (from N(0, 1) inputs they are ~0.05:
    near-uniform attention, which no error in q or k would move)."""
    return hidden((2, len(POSITIONS), model.config.d_model), dtype) * 8


ATTENTION = [pytest.param(n, i, f, id=f"{n}-{i}-{'fast' if f else 'pure'}")
             for n in FAMILIES for i in ("eager", "sdpa") for f in (False, True)]


@DTYPES
@pytest.mark.parametrize("name, impl, fast", ATTENTION)
def test_attention_matches_transformers(models, name, impl, fast, dtype):
    """A causal pass of 24 queries (GQA: 4 query heads on 2 K/V heads; Qwen3: QK-norm) at positions
    1000-1023, eager against eager and SDPA against SDPA."""
    hf, ours = models(name, dtype, impl, fast)
    x = attention_input(ours, dtype)
    with torch.no_grad():
        assert_same_arithmetic(our_attention(ours, x, POSITIONS), hf_attention(hf, x, POSITIONS), name)


@DTYPES
@pytest.mark.parametrize("name, impl, fast", ATTENTION)
def test_attention_through_the_kv_cache_matches_transformers(models, name, impl, fast, dtype):
    """Prefill 16 positions into minillm's KVCache and transformers' DynamicCache, then 4 decode steps
    (one query over every cached key): each step's output against transformers'."""
    hf, ours = models(name, dtype, impl, fast)
    x = attention_input(ours, dtype)
    cache, hf_cache = KVCache.for_model(ours, batch_size=2, max_seq_len=24), DynamicCache(config=hf.config)
    steps = [(0, 16)] + [(t, t + 1) for t in range(16, 20)]
    with torch.no_grad():
        for start, end in steps:
            chunk = x[:, start:end].contiguous()  # (GPT-2's Conv1D views its input)
            got = our_attention(ours, chunk, POSITIONS[start:end], cache)
            expected = hf_attention(hf, chunk, POSITIONS[start:end], hf_cache)
            assert_same_arithmetic(got, expected, f"{name}, positions {start}-{end - 1}")
    assert cache.keys(0).dtype == dtype and cache.length == 20


@DTYPES
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_with_the_wrong_rope_is_rejected(models, impl, dtype):
    """The attention comparison alone catches a RoPE table computed in the model's dtype."""
    hf, ours = models("llama_gqa", dtype, impl)
    x = attention_input(ours, dtype)
    with torch.no_grad():
        for wrong in (angles_in_dtype, inv_freq_in_dtype):
            assert_rejected(our_attention(ours, x, POSITIONS, tables=wrong), hf_attention(hf, x, POSITIONS),
                            wrong.__name__)


# -- MLPs ----------------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("fast", [False, True], ids=["pure", "fast"])
@pytest.mark.parametrize("name", FAMILIES)
def test_mlp_matches_transformers(models, name, fast, dtype):
    """SwiGLU against LlamaMLP (and its Qwen and Mistral copies); GPT-2's MLP against GPT2MLP with the fused
    tanh GELU ("gelu_pytorch_tanh", the same function as the checkpoint's "gelu_new": see the next test)."""
    hf, ours = models(name, dtype, fast=fast)
    x = hidden((2, 40, ours.config.d_model), dtype)
    with torch.no_grad():
        assert_same_arithmetic(ours.blocks[0].mlp(x), hf_layer(hf).mlp(x), name)


def gelu_tanh_written_out(x):
    """GELU's tanh approximation written out in the model's dtype: transformers' NewGELUActivation ("gelu_new"),
    eight roundings where F.gelu(x, approximate="tanh") rounds once."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


@DTYPES
def test_gpt2_mlp_is_at_least_as_accurate_as_gelu_new(models, dtype):
    """Against GPT2MLP with the checkpoint's own "gelu_new", written out in 16 bits: minillm's fused GELU
    rounds once, so it is the closer of the two to float64 on the same 16-bit weights and input."""
    hf, ours = models("gpt2", dtype, fused_gelu=False)
    x = hidden((2, 40, ours.config.d_model), dtype)
    exact = copy.deepcopy(hf_layer(hf).mlp).double()
    with torch.no_grad():
        reference = exact(x.double())
        ours_error, hf_error = error_in_u(ours.blocks[0].mlp(x), reference), error_in_u(hf_layer(hf).mlp(x), reference)
    assert ours_error <= hf_error, f"minillm {ours_error:.3f}u, transformers {hf_error:.3f}u from float64"


def swiglu_silu_written_out(mlp, x):
    """SiLU written out in the model's dtype: gate · sigmoid(gate), two roundings where F.silu rounds once."""
    gate = mlp.gate_proj(x)
    return mlp.down_proj(gate * torch.sigmoid(gate) * mlp.up_proj(x))


def gpt2_mlp_gelu_written_out(mlp, x):
    return mlp.down_proj(gelu_tanh_written_out(mlp.up_proj(x)))


@DTYPES
@pytest.mark.parametrize("name, wrong", [("llama_gqa", swiglu_silu_written_out), ("gpt2", gpt2_mlp_gelu_written_out)],
                         ids=["silu written out", "gelu written out"])
def test_mlp_activation_in_the_wrong_precision_is_rejected(models, name, wrong, dtype):
    hf, ours = models(name, dtype)
    x = hidden((2, 40, ours.config.d_model), dtype)
    with torch.no_grad():
        assert_rejected(wrong(ours.blocks[0].mlp, x), hf_layer(hf).mlp(x), wrong.__name__)


# -- whole models --------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_models_logits_match_transformers(models, name, dtype):
    """Every layer at once on the tiny configs: the full forward's logits (eager). Like for like only where the
    CPU's products sum as transformers' do: GPT-2's Conv1D multiplies by the transposed weight (addmm), whose
    float16 sums on the developers' AMD EPYC differ from F.linear's in the last bit (0.002u for the first MLP's
    product), and two layers of roundings compound that to 0.9u. So the oracle is transformers' float32 model:
    minillm's error from it is within transformers' own 16-bit model's error plus u/2 (gpt2, float16, on that
    EPYC: 1.726u against 1.735u); each module's cast points are checked like for like above."""
    hf, ours = models(name, dtype)
    hf32, _ = models(name, torch.float32)
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf32(ids).logits
        got, theirs = error_in_u(ours(ids), expected, dtype), error_in_u(hf(ids).logits, expected, dtype)
    assert got <= theirs + TOL_U, f"{name}: {got:.3f}u from float32, transformers' {dtype}: {theirs:.3f}u"


PROMPT = ("The KV cache stores keys and values so that decoding one token does not recompute the whole prompt "
          "again and again, which would make every new token slower than the last.")
N_PREFILL, N_TOKENS = 24, 32  # prefill 24 positions, then 8 decode steps (teacher-forced)


def bfloat16_copy(hf32):
    """transformers' float32 model in bfloat16, as ``from_pretrained(..., dtype=torch.bfloat16)`` gives it
    (bit for bit, and seconds faster than reading the GGUF again): ``.to()`` casts every float buffer, RoPE's
    frequencies included, so they are put back in float32."""
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    rope32, rope16 = hf32.model.rotary_emb, hf16.model.rotary_emb
    rope16.inv_freq, rope16.original_inv_freq = rope32.inv_freq.clone(), rope32.original_inv_freq.clone()
    return hf16


def cached_logits(model, ids, hf=False):
    """Logits [N_TOKENS - N_PREFILL + 1, vocab] predicting positions N_PREFILL..N_TOKENS: prefill's last
    row, then one decode step per later token, through minillm's KVCache or transformers' DynamicCache."""
    if hf:
        cache = DynamicCache(config=model.config)
        rows = [model(ids[:, :N_PREFILL], cache=cache, use_cache=True).logits[0, -1]]
        rows += [model(ids[:, i:i + 1], cache=cache, use_cache=True).logits[0, -1] for i in range(N_PREFILL, N_TOKENS)]
        return torch.stack(rows)
    cache = KVCache.for_model(model, max_seq_len=N_TOKENS)
    rows = [prefill(model, ids[:, :N_PREFILL], cache)[0]]
    rows += [decode_step(model, ids[:, i], cache)[0] for i in range(N_PREFILL, N_TOKENS)]
    return torch.stack(rows)


def greedy_flips_are_near_ties(got, expected) -> bool:
    """Where argmax(got) differs from argmax(expected), expected's two candidates were closer than the
    row's largest difference allows telling apart: expected[theirs] - expected[ours] <= 2·max|got - expected|."""
    ours, theirs = got.argmax(-1), expected.argmax(-1)
    gap = expected.gather(-1, theirs[:, None]) - expected.gather(-1, ours[:, None])
    allowed = 2 * (got.float() - expected.float()).abs().amax(-1, keepdim=True)
    return bool((gap.float() <= allowed).all())


@pytest.mark.large
def test_smollm2_bfloat16_logits_match_transformers_bfloat16(smollm2_dir, hf_smollm2, monkeypatch):
    """SmolLM2-135M, real weights, in bfloat16, against transformers in bfloat16 and in float32 on a 32-token
    prompt: the full forward, and prefill of 24 positions + 8 decode steps through the KV caches.

    The yardstick is bfloat16's own error, E = e(transformers bfloat16, transformers float32), measured here:
    3.77u (max |Δlogit| 0.58 on logits of spread (std) 3.4; the greedy token differs at 2 of 32 positions),
    4.6u-7.5u on four other prompts, hence the sanity bound 1 < E < 10. The lesson's modules (fast=False)
    round where transformers does, so they must be much closer to transformers' bfloat16 than either is to
    float32: e <= E/4, full and cached (measured 0: bitwise), the same greedy token at every position, and
    where bfloat16 changes the float32 greedy token, a near tie. The same E/4 rejects the model with its
    RMSNorm in bfloat16 (measured 6.4u: 30 layers grow a sub-ulp error to bfloat16's own size).

    The speed layer (fast=True) multiplies by column-major weights in bfloat16: each product is as accurate
    (0.42u from float64, as row-major) but some shapes sum in another order, and a last-bit difference grows
    over 30 layers to bfloat16's size (measured here 5.8u from transformers' bfloat16 and 4.9u = 1.3E from
    float32; bitwise equal to transformers' on three prompts of 19-20 tokens). So its bound is bfloat16's:
    e(fast, float32) <= 2E, the same for its prefill and decode steps against transformers' cached ones,
    and its greedy flips must be near ties. (A cast point it moves shows in the module tests above.)
    """
    ids = torch.tensor([load_tokenizer(smollm2_dir).encode(PROMPT)[:N_TOKENS]])
    hf16 = bfloat16_copy(hf_smollm2)
    plain = load_model(smollm2_dir, device="cpu", dtype="bfloat16", fast=False)
    fast = load_model(smollm2_dir, device="cpu", dtype="bfloat16", fast=True)
    with torch.no_grad():
        r32, r16 = hf_smollm2(ids).logits[0], hf16(ids).logits[0]
        ours, ours_fast = plain(ids)[0], fast(ids)[0]
        cached, hf_cached = cached_logits(plain, ids), cached_logits(hf16, ids, hf=True)
        fast_cached = cached_logits(fast, ids)
        monkeypatch.setattr(RMSNorm, "forward", rms_norm_in_dtype)
        wrong = plain(ids)[0]

    def e(got, expected):  # (transformers' logits may come back in float32: u of bfloat16 either way)
        return error_in_u(got, expected, torch.bfloat16)

    bf16_error = e(r16, r32)  # E
    measured = {"E": bf16_error, "plain-hf16": e(ours, r16), "plain-hf32": e(ours, r32),
                "cached": e(cached, hf_cached), "rmsnorm in bf16": e(wrong, r16), "fast-hf32": e(ours_fast, r32),
                "fast-hf16": e(ours_fast, r16), "fast cached": e(fast_cached, hf_cached)}
    assert 1 < bf16_error < 10, measured  # bfloat16's error is there to measure, and of its usual size
    assert measured["plain-hf16"] <= min(bf16_error, measured["plain-hf32"]) / 4, measured
    assert measured["cached"] <= bf16_error / 4, measured
    assert torch.equal(ours.argmax(-1), r16.argmax(-1)) and torch.equal(cached.argmax(-1), hf_cached.argmax(-1))
    assert greedy_flips_are_near_ties(ours, r32)
    assert measured["rmsnorm in bf16"] > bf16_error / 4, measured  # the bound's teeth
    assert measured["fast-hf32"] <= 2 * bf16_error and measured["fast cached"] <= 2 * bf16_error, measured
    assert greedy_flips_are_near_ties(ours_fast, r16) and greedy_flips_are_near_ties(fast_cached, hf_cached)

