"""The bound the quantised products at float32's precision keep against float64 (minillm/fast/csrc/quantized_digits.h):
x is written as four base-254 digits under a power-of-two scale s < max|x| / 63.5, so each value is off by at most
0.5 · s / 254³ (the last digit's rounding) plus as much again (float32's rounding of the residuals as they are
scaled up): < 1e-9 · max|x|. The digit sums are exact integers, and what follows them is a few float32 roundings
(2^-24 each) of the result. So |y - y64| <= 1e-9 · max|x| · Σ_k |ŵ_ok| + 5 · 2^-24 · Σ_k |ŵ_ok x_k|, plus in · 2^-149
for results among float32's subnormals (whose roundings are absolute): keeping three digits misses it by up to 254x,
as a row with an outlier shows (tests/fast/test_quantized_amx.py)."""

import torch
import torch.nn.functional as F

from minillm.quantize import QuantizedLinear


def assert_float32_close(y: torch.Tensor, x: torch.Tensor, layer: QuantizedLinear) -> None:
    """y [rows, out] float32 within the bound of F.linear(x, ŵ) in float64, ŵ the layer's dequantised matrix."""
    w = layer.dequantize().double()
    exact = F.linear(x.double(), w)
    largest = x.double().abs().amax(dim=1, keepdim=True)
    subnormal = x.shape[1] * 2.0 ** -149  # a float32 rounding below 2^-126 is this absolute: one a product
    bound = 1e-9 * largest * w.abs().sum(dim=1) + 5 * 2.0 ** -24 * F.linear(x.double().abs(), w.abs()) + subnormal
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all(), ((y.double() - exact).abs() / bound).max()


def layer_of(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
             group_size: int = 64) -> QuantizedLinear:
    """A QuantizedLinear holding these codes (int8 [out, in], or int4 packed [out, in/2] with zero), scales and
    zero points as they are: what quantising a float matrix would not make (scales of 1e37, every code 15)."""
    fmt = "int8" if zero is None else "int4"
    in_features = codes.shape[1] * (1 if zero is None else 2)
    layer = QuantizedLinear(torch.zeros(codes.shape[0], in_features), None, fmt, group_size)
    layer.qweight, layer.scale, layer.zero = codes, scale, zero
    return layer


def special_rows(fmt: str) -> tuple[QuantizedLinear, torch.Tensor]:
    """A [32, 576] layer (in ends with half a block of 128) and six rows of x: zeros, a NaN, an infinity, rows too
    small and too large for a float32 scale (the scalar loop takes those four), and an ordinary one."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 576, generator=g)
    w[:, 7] = 1.0  # no 0 · inf in either format: a clean infinity
    layer = QuantizedLinear(w, None, fmt)
    x = torch.randn(6, 576, generator=g)
    x[0] = 0
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3] *= 1e-36
    x[4] *= 1e35
    return layer, x


def assert_special_rows_are_f_linears(y: torch.Tensor, x: torch.Tensor, layer: QuantizedLinear) -> None:
    """y of :func:`special_rows`: zeros, NaN, F.linear's infinities, and the bound for the rest."""
    reference = layer.forward_reference(x)
    assert torch.equal(y[0], torch.zeros(32))
    assert y[1].isnan().all()
    assert torch.equal(y[2], reference[2]) and y[2].isinf().all()
    assert_float32_close(y[3:], x[3:], layer)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 codes [out, in] (0-15) -> the packed bytes [out, in/2]"""
    return (q[:, 0::2] | q[:, 1::2] << 4).to(torch.uint8)


def range_cases() -> list[tuple[str, QuantizedLinear, torch.Tensor]]:
    """(name, layer, one row of x) whose results lie in float32's range while a scale times x's power-of-two scale
    s, a group's sum times its scale, or a lower digit's sum times both, does not: computed in those orders, each
    gave inf, NaN or 0 (two new users' trials)."""
    codes = torch.zeros(16, 64, dtype=torch.int8)
    codes[:, 1] = 1
    x_big = torch.zeros(1, 64)
    x_big[0, 0], x_big[0, 1] = 1000.0, 1.0  # s = 16: scale · s = 1.6e39
    zeros2 = torch.zeros(16, 2, dtype=torch.uint8)
    half_zero = torch.zeros(16, 128, dtype=torch.uint8)
    half_zero[:, 64:] = 1  # group 0's weights all 0, its scale 1e38
    one_off = torch.ones(16, 128, dtype=torch.uint8)
    one_off[:, 0] = 0
    x_spike = torch.full((1, 128), 2.0 ** -4)
    x_spike[0, 0] = 2.0 ** 10
    fifteens = torch.full((16, 128), 15, dtype=torch.uint8)
    fifteens[:, 0] = 0
    x_low = torch.full((1, 128), 16 * 127 / 254 ** 3)  # its digits below the first: a lower digit's sum is large
    x_low[0, 0] = 64 * 16
    return [
        ("int8, scale 1e38, s 16", layer_of(codes, torch.full((16,), 1e38)), x_big),
        ("int8, scale 1e-15, s 2^-106", layer_of(torch.full((16, 131072), 127, dtype=torch.int8),
                                                 torch.full((16,), 1e-15)), torch.full((1, 131072), 2.0 ** -100)),
        ("int4, scale 2e37, x 1e-20", layer_of(torch.full((16, 4096), 255, dtype=torch.uint8),
                                               torch.full((16, 1), 2e37), torch.zeros(16, 1, dtype=torch.uint8), 8192),
         torch.full((1, 8192), 1e-20)),
        ("int4, a group of zeros with scale 1e38, x 2^20", layer_of(
            pack_int4(half_zero), torch.ones(16, 2).index_fill_(1, torch.tensor([0]), 1e38), zeros2),
         torch.full((1, 128), 2.0 ** 20)),
        ("int4, scale 2.5e37, s 8", layer_of(pack_int4(one_off), torch.full((16, 2), 2.5e37), zeros2), x_spike),
        ("int4, scale 2^-124, s 2^-32", layer_of(torch.full((16, 65536), 255, dtype=torch.uint8),
                                                 torch.full((16, 1), 2.0 ** -124), torch.zeros(16, 1, dtype=torch.uint8),
                                                 131072), torch.full((1, 131072), 126.9 * 2.0 ** -26)),
        ("int4, scale 6.25e32, a lower digit's sum",
         layer_of(pack_int4(fifteens), torch.full((16, 2), 6.25e32), zeros2), x_low),
        ("int8, scale 3e38, x 2^-101 (the scalar loop)", layer_of(torch.full((16, 64), 127, dtype=torch.int8),
                                                                  torch.full((16,), 3e38)),
         torch.full((1, 64), 2.0 ** -101)),
    ]


def sums_that_round_up(lane_ks: torch.Tensor) -> tuple[QuantizedLinear, torch.Tensor]:
    """A new user's trial (int4, in = 131,072, groups of 64): the first block makes every lane's sum large (15 · 127 ·
    8 = 15,240, s = 1), and each later block puts, at its ks 128 b + lane_ks (one k a lane: where the loop's lanes
    hold them), just over half a float32 ulp of that sum: a float32 running sum would round up 1,023 times, 104x
    the bound. -> (layer [16, 131072], x [1, 131072])."""
    w = torch.full((16, 131072), 15.0 * 2.0 ** -12)
    w[:, :128] = 15.0  # scale 1, zero 0: the codes are the weights
    x = torch.zeros(1, 131072)
    x[0, :128] = 127.0
    for b in range(1, 1024):
        x[0, 128 * b + lane_ks] = 1.05 * 2.0 ** (13 - 23) / 2 / (15 * 2.0 ** -12)
    return QuantizedLinear(w, None, "int4", 64), x
