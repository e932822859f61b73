"""int8 and int4 at one row on the vector units (minillm/fast/csrc/quantized_vnni.c), as quantized_matvec runs them
where the build has AVX512-VNNI (AMD Zen 4, an Intel Xeon from Cascade Lake), against float64 F.linear on the
dequantised matrix within tests/fast/digits_bound.py's bound; results whose scales leave float32's range; rows of
zeros, NaN, infinities, tiny and huge values; the largest int32 sums; the shapes it leaves to the float loops.
Skipped where the build has no AVX512-VNNI. (The matrix units' int4 at one row calls the same loop:
tests/fast/test_quantized_amx.py.)"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from digits_bound import (assert_float32_close, assert_special_rows_are_f_linears, layer_of, pack_int4, range_cases,
                          special_rows, sums_that_round_up)
from minillm.fast import kernels
from minillm.quantize import QuantizedLinear


def _vnni():
    if kernels.kernels() is None or not kernels.quantized_vnni_ready():
        pytest.skip("needs a build for AVX-512 with VNNI (an Intel Xeon from Cascade Lake, an AMD from Zen 4)")


def _one_row(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return kernels.quantized_matvec(x, layer.qweight, layer.scale, layer.zero, layer.group_size)


@settings(max_examples=80, deadline=None)
@given(fmt=st.sampled_from(["int8", "int4"]), group=st.sampled_from([64, 128, 192, 256]), n_groups=st.integers(1, 9),
       outs=st.integers(1, 40), values=st.sampled_from(["signed", "positive", "outlier"]),
       magnitude=st.floats(-30, 30), seed=st.integers(0, 2**16))
def test_one_row_equals_float64_linear(fmt, group, n_groups, outs, values, magnitude, seed):
    """in a multiple of 64 (int4: groups of 64, 128, 192 straddling blocks of 128 ks, 256; an in that ends with half a
    block), out a multiple of 4; signed rows, positive ones (int4: their zero-point terms as large as the sums), rows
    with an outlier, each around 10^magnitude."""
    _vnni()
    g = torch.Generator().manual_seed(seed)
    in_features = group * n_groups
    layer = QuantizedLinear(torch.randn(4 * outs, in_features, generator=g), None, fmt, group)
    x = torch.randn(1, in_features, generator=g)
    if values == "positive":
        x = x.abs() + 1
    elif values == "outlier":
        x[0, seed % in_features] = 2e4
    assert_float32_close(_one_row(layer, x * 10.0 ** magnitude), x * 10.0 ** magnitude, layer)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_rows_of_zeros_nan_infinity_and_extreme_sizes_are_f_linears(fmt):
    """A row of zeros gives zeros; a NaN or an infinity gives F.linear's NaN and infinities, and rows too small or too
    large for a float32 scale keep the bound (the scalar loop takes those rows). in = 576 ends with half a block."""
    _vnni()
    layer, x = special_rows(fmt)
    assert_special_rows_are_f_linears(torch.cat([_one_row(layer, row) for row in x.split(1)]), x, layer)


def test_int8_at_one_row_is_the_tiles_bit_for_bit():
    """The same exact int32 sums, combined in the same order: the two units give one answer (where both run)."""
    _vnni()
    if not kernels.quantized_amx_ready():
        pytest.skip("needs AMX-INT8 too")
    g = torch.Generator().manual_seed(5)
    for out_features, in_features in ((960, 576), (64, 1536), (48, 8192)):
        layer = QuantizedLinear(torch.randn(out_features, in_features, generator=g), None, "int8")
        x = torch.randn(1, in_features, generator=g) * 3
        tiles = kernels.quantized_amx_matmul(x, layer.qweight, layer.scale)
        assert torch.equal(_one_row(layer, x), tiles)


@pytest.mark.parametrize("sign", [1, -1])
def test_int8_sums_at_the_largest_in_are_exact(sign):
    """in = 131,072, every code ±127 and every x its row's largest: the largest sums the format allows, D0 = ±131072
    · 127 · 127 (2^31 less 1.6 %), each lane also holding 128 · its digits' sum (the codes' top bit flipped) until
    it is taken out. The answer is exact."""
    _vnni()
    layer = QuantizedLinear(torch.full((4, 131072), sign * 1.0), None, "int8")  # codes ±127, scale 1/127
    x = torch.full((1, 131072), 127 / 128)  # digits (127, 0, 0, 0) under s = 2^-7
    assert torch.equal(layer.qweight, torch.full((4, 131072), sign * 127, dtype=torch.int8))
    assert torch.equal(_one_row(layer, x), F.linear(x.double(), layer.dequantize().double()).float())


def test_int4_pair_sums_at_a_flushs_largest_are_exact():
    """Every code 15 and every zero point 15: ŵ = 0, so y = 0 exactly, though each lane's sums, 254 · T_0 + T_1, and
    their zero terms are near the largest a flush allows (x near its row's largest; a group of 2048, one flush every
    span of four blocks of 128 ks). One k a lane odd: were a flush's sums past 2^24 (a flush a group: 16 blocks),
    float32 would round one of them and y would not be 0 (it failed so)."""
    _vnni()
    x = torch.full((1, 2048), 126 / 128)  # under s = 2^-7: digits (126, 0, 0, 0), 254 · 126 = 32004
    x[0, :128:8] = (126 + 1 / 254) / 128  # one k a lane: (126, 1, ...), 32005
    layer = layer_of(torch.full((4, 1024), 0xFF, dtype=torch.uint8), torch.ones(4, 1),
                     torch.full((4, 1), 15, dtype=torch.uint8), group_size=2048)
    assert torch.equal(_one_row(layer, x), torch.zeros(1, 4))


@pytest.mark.parametrize("group", [64, 128, 192])
def test_every_row_end_keeps_the_bound(group):
    """A row's blocks of 128 ks are taken four at a time (their codes shuffled so that each lane holds one unit of 64
    ks), then two, then one: every in from one group to 24 blocks and a half, groups of 64, 128 and 192 (straddling
    blocks), each group its own scale and zero point, against float64. A lane given another unit's ks, or another
    group's scale, misses the bound by orders of magnitude."""
    _vnni()
    g = torch.Generator().manual_seed(group)
    for in_features in range(group, 3137, group):
        layer = QuantizedLinear(torch.randn(6, in_features, generator=g) * torch.rand(6, in_features, generator=g) * 8,
                                None, "int4", group)
        x = torch.randn(1, in_features, generator=g)
        assert_float32_close(_one_row(layer, x), x, layer)


@pytest.mark.parametrize("lanes", ["a block's", "a span's"])
def test_int4_sums_that_would_all_round_up_keep_the_bound(lanes):
    """digits_bound.sums_that_round_up's row, the later ks placed where a block's lanes hold them or where a span's
    shuffled lanes do: two flushes at a time go into float64 sums."""
    _vnni()
    lane = torch.arange(16)
    layer, x = sums_that_round_up(8 * lane if lanes == "a block's" else 64 * (lane % 2) + 8 * (lane // 2))
    assert_float32_close(_one_row(layer, x), x, layer)


@pytest.mark.parametrize("later", [[512, 1024, 1536], [128, 256, 384]])
def test_int4_roundings_that_all_go_one_way_keep_the_bound(later):
    """A new user's trial: one lane's first flush just above 2^13 (its pair sum and x's scale both rounding up), then
    three more flushes into that lane, each 0.51 of its float32 ulp, and another lane's that rounds the result up:
    summed four flushes at a time in float32, eight roundings in one direction, 1.14x the bound, in this loop (ks
    512 apart: a span's) and the one before (128 apart: a block's). Two flushes at a time and x's scale a power of two
    leave four."""
    _vnni()
    q = torch.zeros(2, 2048, dtype=torch.uint8)
    q[0, :8] = q[0, later] = q[0, 2040] = 15
    layer = layer_of(pack_int4(q), torch.ones(2, 32), torch.zeros(2, 32, dtype=torch.uint8), 64)
    x = torch.zeros(1, 2048)
    x[0, :4] = 127.0  # s = 1
    x[0, 4:8] = torch.tensor([43.57972717285156, 0.3711, 0.3723, 0.3731])  # lane 0's first flush: 15 · 8,290.4
    x[0, later] = x[0, 2040] = 0.51 * 2.0 ** -10 / 15
    assert_float32_close(_one_row(layer, x), x, layer)


@pytest.mark.parametrize("case", range(8))
def test_results_in_float32s_range_stay_there(case):
    """A scale times x's scale (1e38 · 16, 1e-15 · 2^-106, 2^-124 · 2^-32), or a group's sum times its scale (2e37 ·
    15 · 8192), leaves float32's range where the result does not: x's scale goes in first (digits_bound.range_cases:
    each case gave inf, NaN or 0 before)."""
    _vnni()
    _, layer, x = range_cases()[case]
    y = _one_row(layer, x)
    assert y.isfinite().all() and (y != 0).all()
    assert_float32_close(y, x, layer)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_threads_split_the_outputs_not_the_values(fmt):
    _vnni()
    g = torch.Generator().manual_seed(3)
    layer = QuantizedLinear(torch.randn(112, 192, generator=g), None, fmt)
    x = torch.randn(1, 192, generator=g)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_one_row(layer, x))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("fmt, out_features, in_features, group", [
    ("int8", 18, 128, 0),  # out not a multiple of 4
    ("int8", 16, 96, 0),   # in not a multiple of 64
    ("int4", 17, 128, 64),  # out odd
    ("int4", 16, 128, 32),  # groups of 32
    ("int4", 16, 96, 48),
])
def test_shapes_the_loop_does_not_take_run_the_float_loops(fmt, out_features, in_features, group):
    """quantized_matvec keeps its float loops there: F.linear's values up to float32 rounding."""
    _vnni()
    g = torch.Generator().manual_seed(7)
    layer = QuantizedLinear(torch.randn(out_features, in_features, generator=g), None, fmt, group or 64)
    x = torch.randn(1, in_features, generator=g)
    reference = F.linear(x.double(), layer.dequantize().double())
    torch.testing.assert_close(_one_row(layer, x).double(), reference, rtol=1e-5, atol=1e-5)
