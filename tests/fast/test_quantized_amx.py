"""The int8 and int4 products on the matrix units (minillm/fast/csrc/quantized_amx.c) against float64 F.linear on the
dequantised matrix; rows of zeros, NaN, infinities, tiny and huge values; what they refuse. (That they leave
PyTorch's own AMX kernels their tile configuration: tests/fast/test_bf16_amx.py, for every AMX product.) Skipped
where the CPU has no AMX-INT8 (every test but the portable build's).

The bound, and why: tests/fast/digits_bound.py.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from digits_bound import (assert_float32_close, assert_special_rows_are_f_linears, range_cases, special_rows,
                          sums_that_round_up)
from minillm.fast import kernels
from minillm.fast.products import FastQuantizedLinear, swap_class
from minillm.quantize import QuantizedLinear


def _amx():
    if kernels.kernels() is None or not kernels.quantized_amx_ready():
        pytest.skip("needs a CPU with AMX-INT8 (an Intel Xeon from Sapphire Rapids on) and the C kernels")


def _layer(fmt: str, out_features: int, in_features: int, g: torch.Generator, group_size: int = 64) -> QuantizedLinear:
    return QuantizedLinear(torch.randn(out_features, in_features, generator=g), None, fmt, group_size)


def _product(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return kernels.quantized_amx_matmul(x, layer.qweight, layer.scale, layer.zero, layer.group_size)


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(["int8", "int4"]), rows=st.integers(1, 70), out_blocks=st.integers(1, 7),
       in_tiles=st.integers(1, 5), groups_of=st.sampled_from([1, 2]), magnitude=st.floats(-30, 30),
       seed=st.integers(0, 2**16))
def test_quantized_amx_matmul_equals_float64_linear(fmt, rows, out_blocks, in_tiles, groups_of, magnitude, seed):
    """Rows across whole and partial 4-row tiles, pairs and an odd one; outputs in 32s and a last 16; ks in 64s;
    int4 groups of 64 and 128; each row at its own size around 10^magnitude."""
    _amx()
    g = torch.Generator().manual_seed(seed)
    in_features = 64 * groups_of * in_tiles
    layer = _layer(fmt, 16 * out_blocks, in_features, g, 64 * groups_of)
    sizes = 10.0 ** (magnitude + torch.rand(rows, 1, generator=g) * 4 - 2)
    x = torch.randn(rows, in_features, generator=g) * sizes
    assert_float32_close(_product(layer, x), x, layer)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 960, 576), (32, 576, 1536), (700, 96, 128),
                                                              (3, 49152, 576)])
def test_quantized_amx_matmul_at_smollm2_shapes(fmt, rows, out_features, in_features):
    """SmolLM2-135M's q|k|v, down projection and LM head, and 700 rows (three chunks of at most 320)."""
    _amx()
    g = torch.Generator().manual_seed(rows)
    layer = _layer(fmt, out_features, in_features, g)
    x = torch.randn(rows, in_features, generator=g)
    assert_float32_close(_product(layer, x), x, layer)


@settings(max_examples=80, deadline=None)
@given(group=st.sampled_from([64, 128, 192, 256]), n_groups=st.integers(1, 9), out_blocks=st.integers(1, 4),
       values=st.sampled_from(["signed", "positive", "outlier"]), magnitude=st.floats(-30, 30),
       seed=st.integers(0, 2**16))
def test_int4_at_one_row_equals_float64_linear(group, n_groups, out_blocks, values, magnitude, seed):
    """A decode step's product: one row of x, which runs on the vector units (nibble planes by x's digits). Groups of
    64 (two to a block of 128 ks), 128, 192 (straddling blocks) and 256 (two blocks to a group); an in that ends
    with half a block; rows of positive values, whose zero-point terms are as large as the sums (in float32 they
    missed this bound 9x), and rows with an outlier. Beyond 2^100 the scalar loop takes the row (in float32 it
    missed the bound 2.3x with an outlier; it sums in float64)."""
    _amx()
    g = torch.Generator().manual_seed(seed)
    in_features = group * n_groups
    layer = _layer("int4", 16 * out_blocks, in_features, g, group)
    x = torch.randn(1, in_features, generator=g)
    if values == "positive":
        x = x.abs() + 1
    elif values == "outlier":
        x[0, seed % in_features] = 2e4
    x = x * 10.0 ** magnitude
    assert_float32_close(_product(layer, x), x, layer)


@pytest.mark.parametrize("case", ["one group of 8192, x = k + 0.9995", "sparse, groups of 192, x with row 3's signs"])
def test_int4_at_one_row_where_the_lower_digits_share_a_sign(case):
    """A new user's trial's rows: where x's lower digits share a sign, each digit's zero-point term is as large as
    its sums; taken once a row in float32 they missed the bound 1.6x and 1.7x (the first digit's alone was exact)."""
    _amx()
    g = torch.Generator().manual_seed(284)
    if case.startswith("one group"):
        layer = _layer("int4", 16, 8192, g, 8192)
        x = (torch.rand(1, 8192, generator=g) * 127).round() + 0.9995
    else:
        w = torch.randn(16, 576, generator=g) * (torch.rand(16, 576, generator=g) < 0.01)
        layer = QuantizedLinear(w, None, "int4", 192)
        x = (torch.sign(layer.dequantize()[3]) * (torch.rand(576, generator=g) + 0.5)).unsqueeze(0)
    assert_float32_close(_product(layer, x), x, layer)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_row_with_an_outlier_keeps_float32s_precision(fmt):
    """SmolLM2's down projections see rows whose largest value is 10^4 times their median; the digits' error is
    relative to the largest, so the other values need the fourth digit."""
    _amx()
    g = torch.Generator().manual_seed(6)
    layer = _layer(fmt, 64, 1536, g)
    x = torch.randn(5, 1536, generator=g)
    x[:, 7] = 3e4
    y, w = _product(layer, x).double(), layer.dequantize().double()
    exact = F.linear(x.double(), w)
    float32_error = (F.linear(x, layer.dequantize()).double() - exact).abs().max()
    assert (y - exact).abs().max() <= 2 * float32_error
    assert_float32_close(y.float(), x, layer)


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("rows", [1, 5])
def test_results_in_float32s_range_stay_there(case, rows):
    """As on the vector units (tests/fast/test_quantized_vnni.py): on the tiles, x's scale goes in first too."""
    _amx()
    _, layer, x = range_cases()[case]
    x = x.expand(rows, -1).contiguous()
    y = _product(layer, x)
    assert y.isfinite().all() and (y != 0).all()
    assert_float32_close(y, x, layer)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_threads_split_the_outputs_not_the_values(fmt):
    _amx()
    g = torch.Generator().manual_seed(3)
    layer = _layer(fmt, 112, 192, g)
    for x in (torch.randn(23, 192, generator=g), torch.randn(1, 192, generator=g)):  # the tiles; one row (int4: VNNI)
        threads = torch.get_num_threads()
        try:
            results = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                results.append(_product(layer, x))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("one_at_a_time", [False, True])  # True: each row alone (int4: on the vector units)
def test_rows_of_zeros_nan_infinity_and_extreme_sizes_are_f_linears(fmt, one_at_a_time):
    """A row of zeros gives zeros; a NaN or an infinity gives F.linear's NaN and infinities (the scalar loop takes
    those rows, and rows too small or too large for a float32 scale); the other rows are unaffected. in = 576 ends
    with half a block of 128."""
    _amx()
    layer, x = special_rows(fmt)
    y = torch.cat([_product(layer, row) for row in x.split(1)]) if one_at_a_time else _product(layer, x)
    assert_special_rows_are_f_linears(y, x, layer)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_huge_row_whose_values_share_the_weights_signs_keeps_the_bound(fmt, rows):
    """Rows beyond 2^100 take the scalar loop; summed in float32, x with row 0's signs times 1e33 missed the bound
    1.65x (int4) at in = 8,192 and up to 13x at 131,072 (a new user's trial). It sums in float64."""
    _amx()
    g = torch.Generator().manual_seed(1)
    layer = _layer(fmt, 16, 131072, g, 128)
    x = (torch.sign(layer.dequantize()[0]) * (torch.rand(131072, generator=g) + 0.5) * 1e33).expand(rows, -1)
    assert_float32_close(_product(layer, x.contiguous()), x, layer)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("group", [64, 128])
def test_a_long_row_with_the_weights_signs_keeps_the_bound(rows, group):
    """in = 131,072, x with output 0's weights' signs: every product adds up. Each group's float32 sums added in turn
    missed the bound 2.6x on the tiles (two rows) and 1.1x at one row (a new user's trial); the tiles add 16 groups'
    sums apart, then into a total, and one row adds four flushes' sums into float64 ones."""
    _amx()
    g = torch.Generator().manual_seed(2)
    layer = _layer("int4", 32, 131072, g, group)
    x = torch.sign(layer.dequantize()[0]) * (torch.rand(131072, generator=g) + 0.5)
    x = torch.stack([x, torch.randn(131072, generator=g)])[:rows]
    assert_float32_close(_product(layer, x), x, layer)


def test_int4_at_one_row_whose_sums_would_all_round_up_keeps_the_bound():
    """A new user's trial's row: the first block makes every lane's sum large, each later one adds just over half
    its float32 ulp, so a float32 running sum rounds up 1,023 times (104x the bound at in = 131,072). Two flushes
    at a time go into float64 sums (digits_bound.sums_that_round_up)."""
    _amx()
    layer, x = sums_that_round_up(8 * torch.arange(16))
    assert_float32_close(_product(layer, x), x, layer)


@pytest.mark.parametrize("x, q, message", [
    (torch.ones(1, 64, dtype=torch.float64), torch.ones(16, 64, dtype=torch.int8), r"x must be float32 \[rows, 64\]"),
    (torch.ones(1, 64), torch.ones(16, 64, dtype=torch.uint8), r"contiguous 2-D int8"),
    (torch.ones(1, 96), torch.ones(16, 96, dtype=torch.int8), r"in a multiple of 64"),
    (torch.ones(1, 64), torch.ones(24, 64, dtype=torch.int8), r"out a multiple of 16"),
    (torch.ones(1, 131136), torch.ones(16, 131136, dtype=torch.int8), r"a multiple of 64 up to 131072"),
    (torch.ones(1, 128), torch.ones(16, 64, dtype=torch.int8), r"x must be float32 \[rows, 64\]"),
])
def test_quantized_amx_matmul_refuses_what_its_tiles_would_misread(x, q, message):
    _amx()
    with pytest.raises(ValueError, match=message):
        kernels.quantized_amx_matmul(x, q, torch.ones(q.shape[0]))


def test_what_is_not_a_tensor_is_named():
    _amx()
    q = torch.ones(16, 64, dtype=torch.int8)
    with pytest.raises(TypeError, match="takes tensors, got x list"):
        kernels.quantized_amx_matmul([[1.0] * 64], q, torch.ones(16))
    with pytest.raises(TypeError, match="takes tensors, got scale NoneType"):
        kernels.quantized_amx_matmul(torch.ones(1, 64), q, None)
    with pytest.raises(TypeError, match="takes tensors, got x NoneType"):
        kernels.quantized_amx_matmul(None, q, torch.ones(16))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_no_rows_give_no_rows(fmt):
    """Zero rows of x (a prefill chunk before a prompt's last asks the LM head for no logits): [0, out], through the
    kernel and through a layer."""
    _amx()
    layer = _layer(fmt, 32, 128, torch.Generator().manual_seed(7))
    assert _product(layer, torch.ones(0, 128)).shape == (0, 32)
    fast = swap_class(layer, FastQuantizedLinear)
    assert fast(torch.ones(1, 0, 128)).shape == (1, 0, 32)
    with pytest.raises(ValueError, match=r"x must be float32 \[rows, 128\]"):
        fast(torch.ones(0, 100))


def test_the_portable_build_has_no_int8_matrix_units():
    if kernels.kernels(portable=True) is None:
        pytest.skip("needs the C kernels")
    assert kernels.quantized_amx_ready(lib=kernels.kernels(portable=True)) is False


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantised_layer_runs_it_and_still_refuses_a_wrong_width(fmt):
    """FastQuantizedLinear calls the kernel without its checks (the format made the codes), but x's width it checks."""
    _amx()
    layer = swap_class(_layer(fmt, 48, 128, torch.Generator().manual_seed(5)), FastQuantizedLinear)
    x = torch.randn(2, 3, 128)
    assert_float32_close(layer(x).view(6, 48), x.view(6, 128), layer)
    with pytest.raises(ValueError, match=r"x must be float32 \[rows, 128\]"):
        layer(torch.randn(2, 64))
