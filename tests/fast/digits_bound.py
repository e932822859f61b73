"""The bound the quantised products at float32's precision keep against float64 (minillm/fast/csrc/quantized_digits.h):
x is written as four base-254 digits under a power-of-two scale s < max|x| / 63.5, so each value is off by at most
0.5 · s / 254³ (the last digit's rounding) plus as much again (float32's rounding of the residuals as they are
scaled up): < 1e-9 · max|x|. The digit sums are exact integers, and what follows them is a few float32 roundings
(2^-24 each) of the result. So |y - y64| <= 1e-9 · max|x| · Σ_k |ŵ_ok| + 5 · 2^-24 · Σ_k |ŵ_ok x_k|: keeping three
digits misses it by up to 254x, as a row with an outlier shows (tests/fast/test_quantized_amx.py)."""

import torch
import torch.nn.functional as F

from minillm.quantize import QuantizedLinear


def assert_float32_close(y: torch.Tensor, x: torch.Tensor, layer: QuantizedLinear) -> None:
    """y [rows, out] float32 within the bound of F.linear(x, ŵ) in float64, ŵ the layer's dequantised matrix."""
    w = layer.dequantize().double()
    exact = F.linear(x.double(), w)
    largest = x.double().abs().amax(dim=1, keepdim=True)
    bound = 1e-9 * largest * w.abs().sum(dim=1) + 5 * 2.0 ** -24 * F.linear(x.double().abs(), w.abs()) + 1e-37
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all(), ((y.double() - exact).abs() / bound).max()
