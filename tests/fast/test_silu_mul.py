"""The fused SwiGLU activation (minillm/fast/csrc/silu_mul.c) against float64 silu(gate) · up, over drawn
shapes and values (the exp's extremes included), native and portable builds, and the MLP that uses it
against the lesson's."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import CONFIGS

from minillm.config import ModelConfig
from minillm.fast import kernels
from minillm.fast.packing import PackedSwiGLU, Stack
from minillm.fast.products import LINEARS, swap_class
from minillm.model import SwiGLU

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C kernels")


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


BUILDS = pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])


@BUILDS
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 70), half=st.integers(1, 40), scale=st.sampled_from([1e-3, 1.0, 30.0, 200.0]),
       seed=st.integers(0, 2**31 - 1))
def test_silu_mul_equals_float64(rows, half, scale, seed, portable):
    gate_up = torch.randn(rows, 2 * half, generator=torch.Generator().manual_seed(seed)) * scale
    out = kernels.silu_mul(gate_up, lib=kernels.kernels(portable))
    assert out.shape == (rows, half) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(gate_up), rtol=2e-6, atol=1e-30)


@BUILDS
def test_silu_mul_at_the_exps_edges(portable):
    gate = torch.tensor([-1e4, -100.0, -88.0, -87.5, -20.0, -1e-8, 0.0, 1e-8, 20.0, 87.5, 88.0, 100.0, 1e4,
                         -3.4e38, 1e30, 3.0])  # 16: the vector loop and, past 8, its lanes
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)])[None]
    out = kernels.silu_mul(gate_up, lib=kernels.kernels(portable))
    torch.testing.assert_close(out.double(), reference(gate_up), rtol=2e-6, atol=1e-30)


@BUILDS
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 70), half=st.integers(1, 40), scale=st.sampled_from([1e-3, 1.0, 30.0, 200.0]),
       seed=st.integers(0, 2**31 - 1))
def test_silu_mul_in_bfloat16_is_the_lessons_two_ops(rows, half, scale, seed, portable):
    """bfloat16 with the lesson's roundings (silu rounded, then the product): F.silu(gate) * up on the same numbers,
    each value within one bfloat16 step of it (its exp and PyTorch's can part in the float32 silu's last bit), and
    the float64 value within two (the two roundings)."""
    gate_up = (torch.randn(rows, 2 * half, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()
    out = kernels.silu_mul(gate_up, lib=kernels.kernels(portable))
    assert out.shape == (rows, half) and out.dtype == torch.bfloat16
    gate, up = gate_up.chunk(2, dim=-1)
    lesson, exact = (F.silu(gate) * up).double(), reference(gate_up)
    assert ((out.double() - lesson).abs() <= 2**-8 * lesson.abs()).all()
    # (below g = -88.7 float32's exp(-g) overflows and silu is 0, as F.silu's is: off by under 3e-37 < 2^-120, scaled
    # by up)
    assert ((out.double() - exact).abs() <= 2**-7 * exact.abs() + 2**-120 * up.double().abs()).all()


@pytest.mark.parametrize("bad", [torch.zeros(4, 6, dtype=torch.float64), torch.zeros(4, 7),
                                 torch.zeros(6, 4).t()])
def test_silu_mul_refuses_what_it_would_misread(bad):
    with pytest.raises(ValueError, match="silu_mul takes a contiguous float32 or bfloat16 CPU tensor"):
        kernels.silu_mul(bad)


def test_silu_mul_refuses_a_non_tensor_and_autograd():
    with pytest.raises(TypeError, match="silu_mul takes tensors, got gate_up NoneType"):
        kernels.silu_mul(None)
    with pytest.raises(ValueError, match="no backward pass"):
        kernels.silu_mul(torch.zeros(2, 8, requires_grad=True))


def test_the_packed_mlp_with_the_fused_activation_equals_the_lessons():
    family, kwargs = CONFIGS["llama_gqa"]
    config = ModelConfig.from_hf({"model_type": family, **kwargs})
    torch.manual_seed(0)
    mlp = SwiGLU(config)
    x = torch.randn(1, 70, config.d_model)
    with torch.no_grad():
        expected = mlp(x)
        swap_class(mlp, PackedSwiGLU).gate_up = Stack(mlp, ("gate_proj", "up_proj"), LINEARS["linear"], False)
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)
