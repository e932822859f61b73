"""The block with its RMSNorms in C (minillm/fast/block.py, csrc/rms_norm.c): the kernel against float64
RMSNorm over drawn shapes, with and without the residual add, native and portable builds, and the block
against the lesson's."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, decode_step, load_model, prefill
from minillm.fast import kernels
from minillm.fast.block import FastBlock
from minillm.fast.choose import apply_decode_path

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C kernels")


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm written out in float64 (Zhang & Sennrich 2019)."""
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@settings(max_examples=50, deadline=None)
@given(rows=st.integers(0, 80), dim=st.integers(1, 100), scale=st.sampled_from([1e-3, 1.0, 50.0]),
       add=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_rms_norm_equals_float64(rows, dim, scale, add, seed, portable):
    """Dims on and off the vector width, rows on both sides of the threads' threshold, the add or not;
    the native build and the portable one (no -march=native: 4-float vectors)."""
    g = torch.Generator().manual_seed(seed)
    x, delta, weight = torch.randn(rows, dim, generator=g) * scale, torch.randn(rows, dim, generator=g), \
        torch.randn(dim, generator=g)
    total, out = kernels.rms_norm(x, weight, 1e-5, delta=delta if add else None, lib=kernels.kernels(portable))
    expected_total = x.double() + delta.double() if add else x.double()
    torch.testing.assert_close(total.double(), expected_total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), reference(expected_total, weight, 1e-5), rtol=1e-5, atol=1e-5)
    assert total is x if not add else (total.data_ptr() not in (x.data_ptr(), delta.data_ptr()) or rows == 0)


def bfloat16_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None):
    """The lesson's RMSNorm on bfloat16 numbers, its roundings written out on float64 values: the residual add
    rounded, the norm rounded, the product with the weight rounded (HF Llama's order). Returns the sum and the
    outputs that a norm within one bfloat16 unit of the rounded one gives: [3, *x.shape], the norm as rounded,
    one unit up, one unit down, each times the weight, rounded."""
    total = x if delta is None else (x.double() + delta.double()).bfloat16()
    wide = total.double()
    normed = (wide / torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()
    norms = [normed] + [torch.nextafter(normed, torch.full_like(normed, bound)) for bound in (math.inf, -math.inf)]
    return total, torch.stack([(n.double() * weight.double()).bfloat16() for n in norms])


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 80), dim=st.integers(1, 100), scale=st.sampled_from([1e-3, 1.0, 50.0]),
       add=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_bfloat16_rms_norm_rounds_as_the_lesson(rows, dim, scale, add, seed, portable):
    """bfloat16 rows: the residual sum equal to the bit, the norm within one bfloat16 unit of the float64
    reference rounded as the lesson rounds (the sum of squares in float32 can move a value across a
    rounding boundary, never further)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=g) * scale).bfloat16()
    delta, weight = torch.randn(rows, dim, generator=g).bfloat16(), torch.randn(dim, generator=g).bfloat16()
    total, out = kernels.rms_norm(x, weight, 1e-5, delta=delta if add else None, lib=kernels.kernels(portable))
    want_total, allowed = bfloat16_reference(x, weight, 1e-5, delta if add else None)
    assert total.dtype == out.dtype == torch.bfloat16
    assert torch.equal(total, want_total)
    # (a norm one unit off and a weight past 1 in size move the output more than one unit: so the norm is held to
    # one unit, and the product with the weight to its one rounding, not the output to a relative bound)
    assert (out == allowed).any(0).all()


@pytest.mark.parametrize("x, weight, delta", [
    (torch.zeros(3, 8, dtype=torch.float64), torch.ones(8), None),
    (torch.zeros(3, 8), torch.ones(7), None),
    (torch.zeros(8, 3).t(), torch.ones(8), None),
    (torch.zeros(3, 8), torch.ones(8), torch.zeros(2, 8)),
    (torch.zeros(3, 8, dtype=torch.bfloat16), torch.ones(8), None),  # bfloat16 rows, a float32 weight
    (torch.zeros(3, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), None),
])
def test_rms_norm_refuses_what_it_would_misread(x, weight, delta):
    with pytest.raises(ValueError, match="rms_norm takes contiguous CPU x"):
        kernels.rms_norm(x, weight, 1e-5, delta=delta)


@pytest.mark.parametrize("family", ["llama_gqa", "gpt2"])
def test_the_fast_block_gives_the_lessons_logits(family, tmp_path):
    """Prefill and decode on the matvec path (FastBlock) against the plain model; hooks still see every
    block's output (a hooked pass runs the lesson's forward); GPT-2's LayerNorm keeps the lesson's too."""
    name, kwargs = CONFIGS[family]
    model = load_model(save_hf(build_hf(name, kwargs), tmp_path), device="cpu", fast=False)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    logits = []
    for apply in (lambda: None, lambda: apply_decode_path(model, "matvec")):
        apply()
        cache = KVCache.for_model(model, max_seq_len=64)
        logits.append((prefill(model, ids, cache), decode_step(model, torch.tensor([5]), cache)))
    assert all(isinstance(b, FastBlock) for b in model.blocks)
    for plain, fast in zip(*logits):
        assert (plain - fast).abs().max() <= 1e-4
    seen = []
    with torch.inference_mode():
        model(ids[None], hook=lambda name, t: seen.append(name))
    assert sum(n.endswith("hook_resid_post") for n in seen) == model.config.n_layers


def test_the_fast_block_in_bfloat16_is_the_lessons_block(tmp_path):
    """A bfloat16 Llama on the matvec path runs its norms in C (FastBlock): the same greedy tokens as the
    plain bfloat16 model over 8 decode steps, each step's logits within bfloat16's rounding of the plain ones."""
    name, kwargs = CONFIGS["llama_gqa"]
    folder = save_hf(build_hf(name, kwargs), tmp_path)
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(0))
    runs = []
    for fast in (False, True):
        model = load_model(folder, device="cpu", dtype=torch.bfloat16, fast=fast)
        cache = KVCache.for_model(model, max_seq_len=64)
        steps = [prefill(model, ids, cache)]
        for _ in range(8):
            steps.append(decode_step(model, steps[-1].argmax(-1), cache))
        runs.append(torch.stack(steps).float())
    assert all(isinstance(b, FastBlock) for b in model.blocks)
    plain, fast = runs
    assert torch.equal(plain.argmax(-1), fast.argmax(-1))
    assert (plain - fast).abs().max() <= 2**-6 * plain.abs().max()
