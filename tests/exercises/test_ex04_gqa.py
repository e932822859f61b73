"""Exercise 4: grouped-query attention, each K/V head shared by n_heads / n_kv_heads query heads."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exercises import oracles
from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.models import randn
from exercises.registry import EXERCISES, reference
from exercises.test_ex02_attention import draw_attention_inputs

pytestmark = pytest.mark.ex04
REF = reference(EXERCISES["ex04"])
LESSON = "lessons/03-kv-cache.md#grouped-query-attention"
HINT = ("view q as [B, n_kv_heads, n_rep, T, head_dim]: query head h reads K/V head h // n_rep "
        "(heads 0,1 -> K/V 0; heads 2,3 -> K/V 1), as HF's repeat_kv does")


def qkv(B=1, H=4, H_kv=2, T=3, S=3, D=8, seed=0):
    q = randn(B, H, S, D, seed=seed)[:, :, S - T :].contiguous()
    k, v = randn(2, B, H_kv, S, D, seed=seed + 100).unbind(0)
    return q, k, v


def shapes(q, k):
    B, H, T, D = q.shape
    return f"q [{B}, {H}, {T}, {D}], k and v [{B}, {k.shape[1]}, {k.shape[2]}, {D}]  ([B, heads, T or S, head_dim])"


def test_output_has_one_row_per_query_head(impl):
    q, k, v = qkv()
    c = Case("eager_attention(q, k, v)", "4 query heads, 2 K/V heads", shapes=shapes(q, k), lesson=LESSON,
             hint="the output has the query's shape [B, n_heads, T, head_dim]; K/V heads are shared, not summed")
    out = c.call(impl.eager_attention, q, k, v)
    c.true(tuple(out.shape) == tuple(q.shape), "wrong shape", expected=list(q.shape), got=list(out.shape))


def test_consecutive_query_heads_share_a_kv_head(impl):
    q, k, v = qkv(seed=1)
    k2, v2 = k.clone(), v.clone()
    k2[:, 1] += 3.0
    v2[:, 1] -= 3.0  # change K/V head 1 only
    c = Case("eager_attention(q, k, v)", "4 query heads, 2 K/V heads; K/V head 1 changed",
             shapes=shapes(q, k), hint=HINT + ": query heads 0 and 1 must not change", lesson=LESSON)
    before = c.call(impl.eager_attention, q, k, v)
    after = c.call(impl.eager_attention, q, k2, v2)
    c.close(after[:, :2], before[:, :2])
    c.true(not torch.allclose(after[:, 2:], before[:, 2:]), "query heads 2, 3 ignored their K/V head 1",
           hint=HINT)


def test_gqa_equals_attention_with_repeated_kv(impl):
    q, k, v = qkv(B=2, T=4, S=4, seed=2)
    c = Case("eager_attention(q, k, v)", "a batch of two 4-token prompts, 4 query heads, 2 K/V heads",
             shapes=shapes(q, k), hint=HINT, lesson=LESSON)
    c.close(c.call(impl.eager_attention, q, k, v), oracles.attention(q, k, v))


def test_multi_query_attention(impl):
    q, k, v = qkv(H_kv=1, seed=3)
    c = Case("eager_attention(q, k, v)", "multi-query attention: 4 query heads, 1 K/V head",
             shapes=shapes(q, k), hint=HINT + "; with 1 K/V head every query head reads it", lesson=LESSON)
    c.close(c.call(impl.eager_attention, q, k, v), oracles.attention(q, k, v))


def test_gqa_after_a_cache(impl):
    q, k, v = qkv(T=2, S=5, seed=4)
    c = Case("eager_attention(q, k, v)", "2 new queries after 3 cached keys, 4 query heads, 2 K/V heads",
             shapes=shapes(q, k), hint=HINT + "; the mask is causal_mask(T, S)", lesson=LESSON)
    c.close(c.call(impl.eager_attention, q, k, v), oracles.attention(q, k, v))


def test_plain_multi_head_still_works(impl):
    q, k, v = qkv(H_kv=4, seed=5)
    c = Case("eager_attention(q, k, v)", "n_kv_heads = n_heads = 4 (plain multi-head, n_rep = 1)",
             shapes=shapes(q, k), hint=HINT, lesson=LESSON)
    c.close(c.call(impl.eager_attention, q, k, v), oracles.attention(q, k, v))


@given(data=st.data())
@CHECKS
def test_agrees_with_the_reference_for_every_group_size_dtype_and_cache(impl, data):
    n_kv_heads = data.draw(st.integers(1, 3), label="n_kv_heads")
    n_rep = data.draw(st.integers(1, 8), label="n_rep (n_heads / n_kv_heads)")
    agree(impl.eager_attention, REF.eager_attention, draw_attention_inputs(data, n_kv_heads * n_rep, n_kv_heads),
          what="eager_attention", exercise="ex04", lesson=LESSON,
          hint=HINT + "; for every n_rep from 1 (multi-head) to n_heads (multi-query), in float32, bfloat16 and "
                      "float16 (the output keeps q's dtype), T < S after a cache, with the given scale and window "
                      "(passed on to causal_mask), and a softmax that subtracts the max (torch.softmax)")
