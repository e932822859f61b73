"""RoPE in C (csrc/rope.c, minillm/fast/kernels.py's rope): queries and keys rotated in one call, bit for bit the
lesson's apply_rope (its roundings, in float32 and in bfloat16) over drawn shapes, on views of a stacked q|k|v
product as the model hands them, native and portable builds; and the fast model rotating through it."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, decode_step, load_model, prefill
from minillm.fast import kernels
from minillm.rope import RotaryEmbedding, apply_rope

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C kernels")


def stacked_qk(B: int, T: int, H: int, KV: int, D: int, dtype: torch.dtype, g: torch.Generator):
    """q [B, H, T, D] and k [B, KV, T, D] as Attention.forward makes them: views of one q|k|v product."""
    qkv = (torch.randn(B, T, (H + 2 * KV) * D, generator=g) * 3).to(dtype)
    q, k, _ = qkv.split((H * D, KV * D, KV * D), dim=-1)
    return q.view(B, T, H, D).transpose(1, 2), k.view(B, T, KV, D).transpose(1, 2)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 40), kv=st.integers(1, 3), group=st.integers(1, 4),
       half=st.integers(1, 40), start=st.integers(0, 5000), seed=st.integers(0, 2**31 - 1))
def test_rope_equals_apply_rope_bit_for_bit(B, T, kv, group, half, start, seed, dtype, portable):
    """Head sizes on and off the vector width (D = 2..80), rows on both sides of the threads' threshold, real
    angles (the model's RotaryEmbedding at positions up to 5,000)."""
    g = torch.Generator().manual_seed(seed)
    D = 2 * half
    q, k = stacked_qk(B, T, kv * group, kv, D, dtype, g)
    config = SimpleNamespace(head_dim=D, rope_theta=10000.0, rope_scaling=None)  # (the fields RotaryEmbedding reads)
    rotary = RotaryEmbedding(config)
    cos, sin = rotary(torch.arange(start, start + T), dtype)
    got_q, got_k = kernels.rope(q, k, cos, sin, lib=kernels.kernels(portable))
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.dtype == got_k.dtype == dtype
    assert torch.equal(got_q, apply_rope(q, cos, sin)) and torch.equal(got_k, apply_rope(k, cos, sin))


def test_rope_is_the_rotation_in_float64():
    """The lesson's formula, pair by pair: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), against float64."""
    g = torch.Generator().manual_seed(0)
    q, k = stacked_qk(1, 5, 4, 2, 16, torch.float32, g)
    angles = torch.rand(5, 8, generator=g, dtype=torch.float64) * 6
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    got_q, _ = kernels.rope(q, k, cos.float(), sin.float())
    x1, x2 = q.double()[..., :8], q.double()[..., 8:]
    want = torch.cat((x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()), -1)
    torch.testing.assert_close(got_q.double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    ("odd head_dim", "head_dim must be even"), ("dtypes differ", "all float32 or all bfloat16"),
    ("cos shape", "cos, sin \\[T, D\\]"), ("strided head", "must be contiguous"), ("requires grad", "no backward")])
def test_rope_names_the_rule_an_input_breaks(change, message):
    g = torch.Generator().manual_seed(1)
    q, k = stacked_qk(1, 4, 2, 1, 8, torch.float32, g)
    cos, sin = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    if change == "odd head_dim":
        q, k, cos, sin = q[..., :7], k[..., :7], cos[:, :7].contiguous(), sin[:, :7].contiguous()
    elif change == "dtypes differ":
        cos = cos.double()
    elif change == "cos shape":
        cos, sin = cos[:3], sin[:3]
    elif change == "strided head":
        q = q[..., ::2]
        k, cos, sin = k[..., :4], cos[:, :4].contiguous(), sin[:, :4].contiguous()
    else:
        q = q.detach().requires_grad_()
    with pytest.raises(ValueError, match=f"rope: .*{message}.*; use minillm.rope.apply_rope"):
        kernels.rope(q, k, cos, sin)


def test_rope_refuses_a_non_tensor_with_a_type_error():
    q, k = stacked_qk(1, 4, 2, 1, 8, torch.float32, torch.Generator().manual_seed(1))
    with pytest.raises(TypeError, match="rope takes tensors, got cos list"):
        kernels.rope(q, k, [1.0], torch.zeros(4, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_model_rotates_in_c_with_the_lessons_logits(tmp_path, monkeypatch, dtype):
    """A Llama-family model on the speed layer rotates every layer's q and k in C, at prefill and decode; the
    logits are the plain model's up to the other kernels' float rounding."""
    path = save_hf(build_hf(*CONFIGS["llama_gqa"]), tmp_path)
    monkeypatch.setenv("MINILLM_DECODE_PATH", "matvec")  # (the eager step: the replayed one calls the C directly)
    fast = load_model(path, dtype=dtype, fast=True)
    plain = load_model(path, dtype=dtype, fast=False)
    if not fast.blocks[0].attn.c_rope:
        pytest.skip("this model's decode path runs no C kernels")
    original, calls = kernels.rope, []
    monkeypatch.setattr(kernels, "rope", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    ids = torch.arange(12) + 3
    logits = {}
    for name, model in (("fast", fast), ("plain", plain)):
        cache = KVCache.for_model(model, max_seq_len=16)
        first = prefill(model, ids, cache)
        logits[name] = torch.stack([first, decode_step(model, first.argmax(-1), cache)]).float()
    assert len(calls) == 2 * fast.config.n_layers
    tolerance = {"atol": 3e-2, "rtol": 2**-7} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(logits["fast"], logits["plain"], **tolerance)
