"""The bfloat16 product on the matrix units (minillm/fast/csrc/bf16_amx.c) against float64 F.linear on the same
bfloat16 numbers; what it refuses; that it leaves PyTorch's own AMX kernels (SDPA's flash attention, oneDNN's
products) their tile configuration; and that a product module runs it where the rule says. Skipped where the CPU
has no AMX-BF16 (every test but the portable build's answer)."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minillm.fast import kernels
from minillm.fast.products import MatvecLinear
from minillm.quantize import QuantizedLinear

BF16_EPS = 2.0 ** -8  # half of bfloat16's 2^-7 spacing: one rounding to nearest moves a value by at most this


def _amx():
    if kernels.kernels() is None or not kernels.bf16_amx_ready():
        pytest.skip("needs a CPU with AMX-BF16 (an Intel Xeon from Sapphire Rapids on) and the C kernels")


def _assert_one_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """y is x @ wᵀ + bias rounded once to bfloat16: within half a bfloat16 unit of the float64 result, plus the
    float32 sums' rounding (in·2^-24 of Σ|x·w|, Higham's bound for a sum of in terms)."""
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    magnitude = F.linear(x.double().abs(), w.double().abs(), None if bias is None else bias.double().abs())
    bound = BF16_EPS * exact.abs() + (x.shape[1] + 1) * 2.0 ** -24 * magnitude * (1 + BF16_EPS) + 1e-30
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all(), (y.double() - exact).abs().max()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), out_blocks=st.integers(1, 7), in_tiles=st.integers(1, 6), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_bf16_amx_matmul_equals_float64_linear(rows, out_blocks, in_tiles, bias, seed):
    """Rows across whole and partial 16-row blocks, pairs and an odd one; outputs in 32s and a last 16; ks in 32s."""
    _amx()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16 * out_blocks, 32 * in_tiles, generator=g).bfloat16()
    x = torch.randn(rows, 32 * in_tiles, generator=g).bfloat16()
    b = torch.randn(16 * out_blocks, generator=g).bfloat16() if bias else None
    _assert_one_rounding(kernels.bf16_amx_matmul(x, w, b), x, w, b)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 960, 576), (32, 576, 1536), (200, 3072, 576),
                                                              (3, 49152, 576)])
def test_bf16_amx_matmul_at_smollm2_shapes(rows, out_features, in_features):
    _amx()
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    _assert_one_rounding(kernels.bf16_amx_matmul(x, w), x, w)


def test_bf16_amx_matmul_keeps_nan_and_infinity():
    _amx()
    w = torch.ones(16, 32, dtype=torch.bfloat16)
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    y = kernels.bf16_amx_matmul(x, w)
    assert y[0].isnan().all() and (y[1] == float("inf")).all()


@pytest.mark.parametrize("x, w, message", [
    (torch.ones(1, 32), torch.ones(16, 32, dtype=torch.bfloat16), "bfloat16 CPU tensors, got x torch.float32"),
    (torch.ones(1, 48, dtype=torch.bfloat16), torch.ones(16, 48, dtype=torch.bfloat16), r"in a multiple of 32"),
    (torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(24, 32, dtype=torch.bfloat16), r"out a multiple of 16"),
    (torch.ones(0, 32, dtype=torch.bfloat16), torch.ones(16, 32, dtype=torch.bfloat16), r"at least one row"),
    (torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(32, 16, dtype=torch.bfloat16).t(), r"contiguous: False"),
    (torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(16, 64, dtype=torch.bfloat16), r"of the same in"),
])
def test_bf16_amx_matmul_refuses_what_its_tiles_would_misread(x, w, message):
    _amx()
    with pytest.raises(ValueError, match=message):
        kernels.bf16_amx_matmul(x, w)


@pytest.mark.parametrize("bias, message", [
    (torch.ones(16), r"bfloat16 \[out\] = \[16\] on the CPU \(as F.linear takes it\), got torch.float32 \[16\]"),
    (torch.ones(8, dtype=torch.bfloat16), r"got torch.bfloat16 \[8\]"),
    ([1.0] * 16, r"got list"),
])
def test_bf16_amx_matmul_refuses_a_bias_f_linear_would_refuse(bias, message):
    _amx()
    with pytest.raises(ValueError, match=message):
        kernels.bf16_amx_matmul(torch.ones(1, 32, dtype=torch.bfloat16), torch.ones(16, 32, dtype=torch.bfloat16), bias)


def test_bf16_amx_matmul_names_what_is_not_a_tensor():
    _amx()
    with pytest.raises(TypeError, match="takes tensors x and weight, got list and Tensor"):
        kernels.bf16_amx_matmul([[1.0] * 32], torch.ones(16, 32, dtype=torch.bfloat16))


def test_the_op_a_compiled_step_calls_is_the_same_product():
    """torch.ops.minillm.bf16_amx_matmul (csrc/ops.cpp, what a compiled decode step calls) gives the ctypes
    kernel's values to the bit, with and without a bias, and refuses in one line what the tiles would misread."""
    _amx()
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler")
    kernels.prepare_for_compile()
    assert kernels.ops_implementation() == ("C++", None)
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    for bias in (None, torch.randn(96, generator=g).bfloat16()):
        assert torch.equal(torch.ops.minillm.bf16_amx_matmul(x, w, bias), kernels.bf16_amx_matmul(x, w, bias))
    with pytest.raises(RuntimeError, match=r"needs in a multiple of 32, out a multiple of 16 .* got weight \[16, 48\]"):
        torch.ops.minillm.bf16_amx_matmul(x[:, :48], w[:16, :48].contiguous(), None)
    with pytest.raises(RuntimeError, match=r"takes bfloat16 CPU x \[rows, in\], .* got x Float \[5, 64\]"):
        torch.ops.minillm.bf16_amx_matmul(x.float(), w, None)


def test_the_portable_build_has_no_matrix_units():
    if kernels.kernels(portable=True) is None:
        pytest.skip("needs the C kernels")
    assert kernels.bf16_amx_ready(lib=kernels.kernels(portable=True)) is False


@pytest.mark.parametrize("product", ["bfloat16", "int8", "int4"])
def test_pytorchs_own_amx_kernels_keep_their_tile_configuration(product):
    """SDPA's bfloat16 flash attention (PyTorch's brgemm) and oneDNN keep a tile configuration loaded between
    calls; each of minillm's AMX products (bf16_amx.c, quantized_amx.c) puts the caller's back, so theirs give the
    same bits before and after it, in turn."""
    _amx()
    if product != "bfloat16" and not kernels.quantized_amx_ready():
        pytest.skip("needs a CPU with AMX-INT8")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 9, 200, 64, generator=g).bfloat16(), torch.randn(1, 3, 200, 64, generator=g).bfloat16()
    x, w = torch.randn(300, 576, generator=g).bfloat16(), torch.randn(576, 576, generator=g).bfloat16()
    attention = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    result = F.linear(x, w)
    layer = None if product == "bfloat16" else QuantizedLinear(torch.randn(576, 576, generator=g), None, product)

    def run(rows: int) -> None:
        if layer is None:
            kernels.bf16_amx_matmul(x[:rows], w)
        else:
            kernels.quantized_amx_matmul(torch.randn(rows, 576, generator=g), layer.qweight, layer.scale, layer.zero,
                                         layer.group_size)
    for rows in (1, 8, 40, 300):
        run(rows)
        assert torch.equal(F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True), attention)
        run(rows)
        assert torch.equal(F.linear(x, w), result)


@pytest.mark.parametrize("rows, bias, ran", [(1, False, True), (64, True, True), (256, False, True),
                                             (257, False, False)])
def test_a_bfloat16_product_module_runs_it_up_to_the_tables_rows(rows, bias, ran, monkeypatch):
    """MatvecLinear runs bf16_amx_matmul for 1-256 bfloat16 rows of a weight that fits (F.linear above), bias and
    all, with F.linear's values up to the sums' order."""
    _amx()
    calls = []
    kernel = kernels.bf16_amx_unchecked
    monkeypatch.setattr(kernels, "bf16_amx_unchecked", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    g = torch.Generator().manual_seed(rows)
    linear = MatvecLinear(64, 48, bias=bias).to(torch.bfloat16)
    linear.weight = nn.Parameter(torch.randn(48, 64, generator=g).bfloat16(), requires_grad=False)
    x = torch.randn(1, rows, 64, generator=g).bfloat16()
    with torch.inference_mode():
        y = linear(x)
    assert bool(calls) is ran
    _assert_one_rounding(y[0], x[0], linear.weight, linear.bias)
