"""Exercise 18: int4 group quantisation: scales, zero points, the short last group, two codes a byte."""

import pytest
import torch

from exercises.checking import Case
from exercises.models import randn
from minillm.quantize import dequantize_int4, quantize_int4

pytestmark = pytest.mark.ex18
LESSON = "lessons/09-optimisations.md#weight-only-quantisation"
RULE = ("per group: lo = min(0, min w), hi = max(0, max w), scale = (hi - lo) / 15, zero = round(-lo / scale), "
        "q = clamp(round(w / scale) + zero, 0, 15); byte j = q[2j] | q[2j+1] << 4")


def test_codes_by_hand(impl):
    c = Case("quantize_int4(w=[[-1.0, 0.5]], group_size=2)", "one group: lo -1, hi 0.5, so scale 0.1 and zero 10; "
             "the codes are 0 and 15, packed into one byte 0 | 15 << 4 = 240",
             shapes="packed [1, 1] uint8, scale [1, 1] float32, zero [1, 1] uint8", lesson=LESSON,
             hint="scale = (max - min) / 15 spreads the 16 codes over the group's whole range, not max / 15; " + RULE)
    packed, scale, zero = c.call(impl.quantize_int4, torch.tensor([[-1.0, 0.5]]), 2)
    c.close(scale, torch.tensor([[0.1]]))
    c.equal(zero, torch.tensor([[10]], dtype=torch.uint8))
    c.equal(packed, torch.tensor([[240]], dtype=torch.uint8))


def _one_sided(impl, values, zero):  # a helper, not a check: checks take impl only
    c = Case(f"quantize_int4(w=[{values}], group_size=4)", "a group of one sign: 0 is kept inside the range, so "
             f"the zero point is {zero}", shapes="zero [1, 1] uint8", lesson=LESSON,
             hint="lo = min(0, min w) and hi = max(0, max w): an all-positive group starts at 0 (zero point 0), "
                  "an all-negative one ends at 0 (zero point 15); a symmetric scheme has no zero point at all")
    _, scale, z = c.call(impl.quantize_int4, torch.tensor([values]), 4)
    c.equal(z, torch.tensor([[zero]], dtype=torch.uint8))
    c.close(scale, torch.tensor([[3.0 / 15]]))


def test_zero_points_of_one_sided_groups(impl):
    _one_sided(impl, [0.5, 1.5, 3.0, 0.1], 0)
    _one_sided(impl, [-0.5, -1.5, -3.0, -0.1], 15)


def test_constant_and_zero_groups_come_back_exactly(impl):
    w = torch.tensor([[2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    c = Case("dequantize_int4(*quantize_int4(w, 4), 8, 4)", "a constant group [2, 2, 2, 2] and an all-zero group",
             shapes="w [1, 8]: 2 groups of 4", lesson=LESSON,
             hint="a constant group still has 0 in its range ([0, 2]: scale 2/15, code 15); an all-zero group has "
                  "hi == lo: use scale 1, not a division by 0 (NaN)")
    packed, scale, zero = c.call(impl.quantize_int4, w, 4)
    c.close(c.call(impl.dequantize_int4, packed, scale, zero, 8, 4), w)


def test_nibble_order(impl):
    w = torch.tensor([[1.0 / 15, 2.0 / 15, 15.0 / 15, 0.0]])  # one group: scale 1/15, zero 0, codes 1, 2, 15, 0
    c = Case("quantize_int4(w, group_size=4)", "codes 1, 2, 15, 0 pack into bytes 0x21 and 0x0F",
             shapes="packed [1, 2] uint8", lesson=LESSON,
             hint="the earlier element goes in the low nibble: byte j = q[2j] | q[2j + 1] << 4 (0x21 = 1 | 2 << 4)")
    packed, _, _ = c.call(impl.quantize_int4, w, 4)
    c.equal(packed, torch.tensor([[0x21, 0x0F]], dtype=torch.uint8))


def test_short_last_group(impl):
    w = randn(3, 70, seed=18) + 0.3
    c = Case("quantize_int4(w, group_size=32)", "70 inputs in groups of 32: groups of 32, 32 and 6",
             shapes="w [3, 70] -> packed [3, 35], scale and zero [3, 3]", lesson=LESSON,
             hint="n_groups = ceil(in / group_size): the last 6 weights are a group of their own, with the scale "
                  "and zero of their own values (pad them, or slice them, but do not drop them)")
    packed, scale, zero = c.call(impl.quantize_int4, w, 32)
    ref_packed, ref_scale, ref_zero = quantize_int4(w, 32)
    c.equal(packed, ref_packed)
    c.close(scale, ref_scale)
    c.equal(zero, ref_zero)


def test_round_trip_within_half_a_step(impl):
    w = randn(4, 128, seed=3) * 2
    c = Case("dequantize_int4(*quantize_int4(w, 64), 128, 64)", "random weights, 2 groups of 64 a row",
             shapes="w [4, 128]", lesson=LESSON, hint="ŵ = (q - zero) · scale, each weight with its own group's "
             "scale and zero; rounding to the nearest code keeps |w - ŵ| <= scale / 2. " + RULE)
    packed, scale, zero = c.call(impl.quantize_int4, w, 64)
    w_hat = c.call(impl.dequantize_int4, packed, scale, zero, 128, 64)
    c.close(w_hat, dequantize_int4(*quantize_int4(w, 64), 128, 64))
    step = scale.repeat_interleave(64, dim=1)
    c.true(bool(((w - w_hat).abs() <= step / 2 * (1 + 1e-6)).all()), "an error above half a step",
           expected="|w - ŵ| <= scale / 2", got=f"max |w - ŵ| / scale = {((w - w_hat).abs() / step).max():.3f}")


def test_dequantize_reads_the_reference_codes(impl):
    w = randn(2, 70, seed=5)
    packed, scale, zero = quantize_int4(w, 32)
    c = Case("dequantize_int4(packed, scale, zero, in_features=70, group_size=32)",
             "minillm's codes for 70 inputs (a short last group of 6; 35 bytes a row)",
             shapes="packed [2, 35] uint8, scale/zero [2, 3] -> [2, 70] float32", lesson=LESSON,
             hint="unpack low nibble (p & 15) then high (p >> 4) for each byte, subtract the group's zero BEFORE "
                  "multiplying by its scale, and cut the row back to in_features")
    c.close(c.call(impl.dequantize_int4, packed, scale, zero, 70, 32), dequantize_int4(packed, scale, zero, 70, 32))
