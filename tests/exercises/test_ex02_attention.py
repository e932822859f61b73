"""Exercise 2: scaled dot-product attention, written out (one K/V head per query head)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exercises import oracles
from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.models import randn
from exercises.registry import EXERCISES, reference

pytestmark = pytest.mark.ex02
LESSON = "lessons/01-what-is-inference.md#attention"
SHAPES = "q [{B}, {H}, {T}, {D}], k and v [{B}, {H}, {S}, {D}]  ([B, n_heads, T or S, head_dim])"
REF = reference(EXERCISES["ex02"])
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def qkv(B=1, H=2, T=3, S=3, D=4, seed=0):
    q, k, v = randn(3, B, H, S, D, seed=seed).unbind(0)
    return q[:, :, S - T :].contiguous(), k, v


def shapes(q, k):
    B, H, T, D = q.shape
    return SHAPES.format(B=B, H=H, T=T, S=k.shape[2], D=D)


def test_one_key_gives_its_value(impl):
    q, k, v = qkv(T=1, S=1)
    c = Case("eager_attention(q, k, v)", "the first token of a prompt: 1 query, 1 key", shapes=shapes(q, k),
             hint="with a single key the softmax weight is 1, so the output is v itself", lesson=LESSON)
    c.close(c.call(impl.eager_attention, q, k, v), v)


def test_scores_are_scaled_by_sqrt_head_dim(impl):
    q, k, v = qkv(T=3, S=3, D=4, seed=1)
    q = 3 * q  # large scores: a missing or wrong scale changes the softmax a lot
    c = Case("eager_attention(q, k, v)[:, :, -1]", "a 3-token prompt, head_dim 4: the last token, which sees "
             "all 3 keys", shapes=shapes(q, k),
             hint="scores = q·kᵀ / √head_dim (here / 2), then the softmax over the keys, then · v", lesson=LESSON)
    c.close(c.call(impl.eager_attention, q, k, v)[:, :, -1], oracles.attention(q, k, v)[:, :, -1])


def test_weights_sum_to_one_over_the_keys(impl):
    q, k, _ = qkv(T=3, S=3, seed=2)
    ones = torch.ones_like(k)
    c = Case("eager_attention(q, k, v=1)", "a 3-token prompt with every value = 1", shapes=shapes(q, k),
             hint="the softmax runs over the keys (the last dim of the scores [.., T, S]), so each query's "
                  "weights sum to 1 and averaging ones gives ones", lesson=LESSON)
    c.close(c.call(impl.eager_attention, q, k, ones), torch.ones_like(q))


def test_no_query_sees_a_later_token(impl):
    q, k, v = qkv(T=4, S=4, seed=3)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] -= 5.0  # change only the last token's key and value
    c = Case("eager_attention(q, k, v)", "a 4-token prompt; the last token's K/V changed",
             shapes=shapes(q, k), lesson=LESSON,
             hint="apply the causal mask (scores of later keys = -inf before the softmax): tokens 0..2 "
                  "must not see token 3, so their outputs cannot change")
    before = c.call(impl.eager_attention, q, k, v)
    after = c.call(impl.eager_attention, q, k2, v2)
    c.close(after[:, :, :3], before[:, :, :3])


def test_prompt_matches_the_formula(impl):
    q, k, v = qkv(B=2, H=2, T=5, S=5, D=8, seed=4)
    c = Case("eager_attention(q, k, v)", "a batch of two 5-token prompts", shapes=shapes(q, k),
             hint="softmax(q·kᵀ / √head_dim + causal mask) · v, per batch and head", lesson=LESSON)
    c.close(c.call(impl.eager_attention, q, k, v), oracles.attention(q, k, v))


def test_queries_after_a_cache_see_the_cached_keys(impl):
    q, k, v = qkv(T=2, S=5, seed=5)
    c = Case("eager_attention(q, k, v)", "2 new queries (positions 3, 4) after 3 cached keys: T=2 < S=5",
             shapes=shapes(q, k), lesson=LESSON,
             hint="with a cache the queries are the last T of S positions: the mask is causal_mask(T, S), "
                  "a rectangle where query i sees keys 0..S-T+i (not a square T×T tril)")
    c.close(c.call(impl.eager_attention, q, k, v), oracles.attention(q, k, v))


def test_an_explicit_scale_replaces_one_over_sqrt_head_dim(impl):
    q, k, v = qkv(B=3, H=2, T=2, S=6, D=8, seed=6)
    c = Case("eager_attention(q, k, v, scale=0.0625)", "a batch of 3, 2 queries after 4 cached keys, head_dim 8, "
             "and a model whose config sets its own attention scale (Gemma's query_pre_attn_scalar: 1/256 ** 0.5)",
             shapes=shapes(q, k), lesson=LESSON,
             hint="scores = q·kᵀ · scale, with scale = 1/√head_dim only when it is None (the docstring's "
                  "ModelConfig.attn_scale)")
    c.close(c.call(impl.eager_attention, q, k, v, scale=0.0625), oracles.attention(q, k, v, scale=0.0625))


def draw_attention_inputs(data, n_heads: int, n_kv_heads: int):
    """Draw one call of eager_attention over its documented domain; returns inputs() for ``agree``.

    dtypes float32, bfloat16, float16; batch 1..3; S keys 1..12 and T <= S queries (T < S: queries after a
    KV cache); head_dim 2..32; the default scale or an explicit one; no window or one of 1..S+2. Half the
    draws have LARGE scores (integer q and k, exact in every dtype, with a power-of-two scale so the scores
    are exact too, up to a few hundred): a softmax without the max subtracted overflows there (exp(12) is
    past float16's largest number, exp(89) past float32's) and gives inf / inf = NaN.
    """
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B = data.draw(st.integers(1, 3), label="batch")
    S = data.draw(st.integers(1, 12), label="S (keys)")
    T = data.draw(st.integers(1, S), label="T (queries)")
    window = data.draw(st.none() | st.integers(1, S + 2), label="window")
    large = data.draw(st.booleans(), label="large scores")
    if large:
        D = data.draw(st.sampled_from([4, 16]), label="head_dim")
        scale = data.draw(st.sampled_from([None, 1.0, 0.5]), label="scale")
    else:
        D = data.draw(st.sampled_from([2, 4, 8, 16, 32]), label="head_dim")
        scale = data.draw(st.none() | st.sampled_from([0.0625, 0.125, 1.0]) | st.floats(0.01, 1.0), label="scale")
    seed = data.draw(st.integers(0, 2**16), label="seed")

    def inputs():
        g = torch.Generator().manual_seed(seed)
        if large:  # |q|, |k| <= 4: q·k is an integer up to 256, exact in bfloat16 and float16
            q = torch.randint(-4, 5, (B, n_heads, T, D), generator=g).to(dtype)
            k = torch.randint(-4, 5, (B, n_kv_heads, S, D), generator=g).to(dtype)
        else:
            q = torch.randn(B, n_heads, T, D, generator=g).to(dtype)
            k = torch.randn(B, n_kv_heads, S, D, generator=g).to(dtype)
        v = torch.randn(B, n_kv_heads, S, D, generator=g).to(dtype)
        kwargs = {name: x for name, x in (("scale", scale), ("window", window)) if x is not None}
        return (q, k, v), kwargs

    return inputs


@given(data=st.data())
@CHECKS
def test_agrees_with_the_reference_in_every_dtype_size_scale_and_window(impl, data):
    H = data.draw(st.integers(1, 3), label="n_heads (= n_kv_heads)")
    agree(impl.eager_attention, REF.eager_attention, draw_attention_inputs(data, H, H),
          what="eager_attention", exercise="ex02", lesson=LESSON,
          hint="scores = q·kᵀ · scale (1/√head_dim when scale is None), -inf where causal_mask(T, S, device, window) "
               "is False, a softmax over the keys that subtracts the row's max first (torch.softmax does; "
               "exp of a large score is inf in float16), then · v; the output keeps q's shape and dtype, "
               "and q, k, v are left as they were")
