"""Exercise 18: int4 group quantisation: scales, zero points, the short last group, two codes a byte."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.models import randn
from exercises.registry import EXERCISES, reference
from minillm.quantize import dequantize_int4, quantize_int4

pytestmark = pytest.mark.ex18
LESSON = "lessons/09-optimisations.md#weight-only-quantisation"
RULE = ("per group: lo = min(0, min w), hi = max(0, max w), scale = (hi - lo) / 15, zero = round(-lo / scale), "
        "q = clamp(round(w / scale) + zero, 0, 15); byte j = q[2j] | q[2j+1] << 4")


NIBBLES = "the earlier element goes in the LOW nibble: byte j = q[2j] | q[2j + 1] << 4"


def equal_packed(c, packed, expected: torch.Tensor, hint: str) -> None:
    """c.equal on packed bytes, saying so when each byte has its two nibbles the other way round."""
    __tracebackhide__ = True
    swapped = (expected << 4) | (expected >> 4)
    if (isinstance(packed, torch.Tensor) and packed.shape == expected.shape and packed.dtype == expected.dtype
            and not torch.equal(packed, expected) and torch.equal(packed, swapped)):
        c.fail("the two codes of each byte are in the wrong order (high nibble first)", expected, packed,
               hint=f"{NIBBLES}: yours puts q[2j] in the high nibble (q[2j] << 4 | q[2j + 1]), which no int4 kernel "
                    "reads; swap the two")
    c.equal(packed, expected, hint=hint)


def test_codes_by_hand(impl):
    c = Case("quantize_int4(w=[[-1.0, 0.5]], group_size=2)", "one group: lo -1, hi 0.5, so scale 0.1 and zero 10; "
             "the codes are 0 and 15, packed into one byte 0 | 15 << 4 = 240",
             shapes="packed [1, 1] uint8, scale [1, 1] float32, zero [1, 1] uint8", lesson=LESSON, hint=RULE)
    packed, scale, zero = c.call(impl.quantize_int4, torch.tensor([[-1.0, 0.5]]), 2)
    c.close(scale, torch.tensor([[0.1]]), hint="the scale: (hi - lo) / 15 = (0.5 + 1) / 15 = 0.1 spreads the 16 codes "
                                                "over the group's whole range, not max / 15; " + RULE)
    c.equal(zero, torch.tensor([[10]], dtype=torch.uint8), hint="the zero point: round(-lo / scale) = round(1 / 0.1) "
                                                                "= 10, the code that stands for 0.0; " + RULE)
    equal_packed(c, packed, torch.tensor([[240]], dtype=torch.uint8),
                 hint="the codes: round(-1 / 0.1) + 10 = 0 and round(0.5 / 0.1) + 10 = 15, one byte " + NIBBLES
                      + " = 0 | 15 << 4 = 240; " + RULE)


ONE_SIDED = (([0.5, 1.5, 3.0, 0.1], 0), ([-0.5, -1.5, -3.0, -0.1], 15))  # (a group of one sign, its zero point)


def test_zero_points_of_one_sided_groups(impl):
    for values, zero in ONE_SIDED:
        c = Case(f"the zero point of quantize_int4(w=[{values}], group_size=4)", "a group of one sign: 0 is kept "
                 f"inside the range, so the zero point is {zero}", shapes="zero [1, 1] uint8", lesson=LESSON,
                 hint="lo = min(0, min w) and hi = max(0, max w): an all-positive group starts at 0 (zero point 0), "
                      "an all-negative one ends at 0 (zero point 15); a symmetric scheme has no zero point at all")
        _, _, z = c.call(impl.quantize_int4, torch.tensor([values]), 4)
        c.equal(z, torch.tensor([[zero]], dtype=torch.uint8))


def test_scales_of_one_sided_groups(impl):
    for values, _ in ONE_SIDED:
        far = max(values, key=abs)
        c = Case(f"the scale of quantize_int4(w=[{values}], group_size=4)", f"a group of one sign: its range runs "
                 f"from 0 to {far}, so the scale is 3.0 / 15 = 0.2", shapes="scale [1, 1] float32", lesson=LESSON,
                 hint="scale = (hi - lo) / 15 with lo = min(0, min w) and hi = max(0, max w): the range always "
                      "reaches 0, so it is 3.0 wide and the scale 0.2 (not 2.9 / 15 = 0.1933 from the group's own min "
                      "and max, which leaves 0 out, nor 3.0 / 7 from a symmetric scheme)")
        _, scale, _ = c.call(impl.quantize_int4, torch.tensor([values]), 4)
        c.close(scale, torch.tensor([[3.0 / 15]]))


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
             hint=NIBBLES + " (0x21 = 1 | 2 << 4)")
    packed, _, _ = c.call(impl.quantize_int4, w, 4)
    equal_packed(c, packed, torch.tensor([[0x21, 0x0F]], dtype=torch.uint8), hint=c.hint)


def test_short_last_group(impl):
    w = randn(3, 70, seed=18) + 0.3
    c = Case("quantize_int4(w, group_size=32)", "70 inputs in groups of 32: groups of 32, 32 and 6",
             shapes="w [3, 70] -> packed [3, 35], scale and zero [3, 3]", lesson=LESSON,
             hint="n_groups = ceil(in / group_size): the last 6 weights are a group of their own, with the scale "
                  "and zero of their own values (pad them, or slice them, but do not drop them)")
    packed, scale, zero = c.call(impl.quantize_int4, w, 32)
    ref_packed, ref_scale, ref_zero = quantize_int4(w, 32)
    equal_packed(c, packed, ref_packed, hint=c.hint)
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


# -- differential checks (issue 30): odd widths, every group size, half-precision weights, flat rows --------

REF = reference(EXERCISES["ex18"])
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROWS = ["normal", "normal", "positive", "negative", "constant", "zero", "large"]


def weights(out: int, n_in: int, dtype: str, kinds: tuple, seed: int) -> torch.Tensor:
    """[out, n_in] weights in dtype, row r of kind kinds[r]: random, one-signed, all equal, all 0 or large."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for kind in kinds[:out]:
        x = torch.randn(n_in, generator=g)
        rows.append({"normal": x, "positive": x.abs() + 0.1, "negative": -x.abs() - 0.1,
                     "constant": torch.full((n_in,), 0.75), "zero": torch.zeros(n_in), "large": 60 * x}[kind])
    return torch.stack(rows).to(DTYPES[dtype])


@st.composite
def int4_inputs(draw):
    group_size = draw(st.sampled_from([2, 3, 4, 8, 16, 32, 64]) | st.integers(2, 80), label="group_size")
    n_in = draw(st.sampled_from(sorted({1, 2, 3, group_size - 1, group_size, group_size + 1, 2 * group_size + 1} - {0}))
                | st.integers(1, 130), label="in_features")
    out = draw(st.integers(1, 4), label="out_features")
    kinds = tuple(draw(st.lists(st.sampled_from(ROWS), min_size=out, max_size=out), label="rows"))
    dtype = draw(st.sampled_from(list(DTYPES)), label="dtype")
    seed = draw(st.integers(0, 2**16), label="seed")
    return out, n_in, group_size, kinds, dtype, seed


@given(data=st.data())
@CHECKS
def test_quantize_agrees_with_the_reference_on_every_shape_and_dtype(impl, data):
    out, n_in, group_size, kinds, dtype, seed = data.draw(int4_inputs(), label="w")
    if data.draw(st.integers(0, 9), label="group_size below 2?") == 0:
        group_size = data.draw(st.sampled_from([1, 0, -1, -64]), label="invalid group_size")
    agree(impl.quantize_int4, REF.quantize_int4, lambda: ((weights(out, n_in, dtype, kinds, seed), group_size), {}),
          what="quantize_int4", exercise="ex18", lesson=LESSON,
          hint=RULE + "; compute in float32 whatever w's dtype (w.float()); an odd in_features pads the last byte's "
                      "high nibble with 0 (no view(out, -1, 2)); the short last group has its own scale and zero; "
                      "an all-zero group gets scale 1; QuantizationError for group_size < 2")


@given(data=st.data())
@CHECKS
def test_round_trip_within_half_a_step_on_every_dtype(impl, data):
    out, n_in, group_size, kinds, dtype, seed = data.draw(int4_inputs(), label="w")
    w = weights(out, n_in, dtype, kinds, seed)
    c = Case(f"dequantize_int4(*quantize_int4(w, {group_size}), {n_in}, {group_size})",
             f"w [{out}, {n_in}] {dtype}, rows: {', '.join(kinds)}", shapes="-> [out, in] float32", lesson=LESSON,
             hint="the docstring's bound: |w - ŵ| <= scale / 2 for every weight, measured against w itself; in "
                  "bfloat16 or float16 arithmetic the scale and w / scale round, and the error passes half a step: "
                  "upcast first (w.float()). " + RULE)
    packed, scale, zero = c.call(impl.quantize_int4, w.clone(), group_size)
    w_hat = c.call(impl.dequantize_int4, packed, scale, zero, n_in, group_size)
    c.true(isinstance(w_hat, torch.Tensor) and w_hat.shape == (out, n_in) and w_hat.dtype == torch.float32,
           "the round trip is not a float32 [out, in] tensor", expected=f"float32 [{out}, {n_in}]",
           got=f"{getattr(w_hat, 'dtype', type(w_hat).__name__)} {list(getattr(w_hat, 'shape', []))}")
    step = scale.float().repeat_interleave(group_size, dim=1)[:, :n_in]
    ratio = ((w.float() - w_hat).abs() / step).max().item()
    c.true(ratio <= 0.5 * (1 + 1e-5), "an error above half a step", expected="max |w - ŵ| / scale <= 0.5",
           got=f"max |w - ŵ| / scale = {ratio:.3f}")


@given(data=st.data())
@CHECKS
def test_dequantize_agrees_with_the_reference_on_any_codes(impl, data):
    out, n_in, group_size, _, _, seed = data.draw(int4_inputs(), label="shape")
    n_groups = -(-n_in // group_size)

    def inputs():
        g = torch.Generator().manual_seed(seed)
        packed = torch.randint(0, 256, (out, (n_in + 1) // 2), generator=g, dtype=torch.uint8)
        scale = torch.rand(out, n_groups, generator=g) * 2 + 1e-3
        zero = torch.randint(0, 16, (out, n_groups), generator=g, dtype=torch.uint8)
        return (packed, scale, zero, n_in, group_size), {}

    agree(impl.dequantize_int4, REF.dequantize_int4, inputs, what="dequantize_int4", exercise="ex18", lesson=LESSON,
          hint="q[2j] = byte j & 15, q[2j+1] = byte j >> 4; ŵ = (q - zero) · scale with the group's zero and scale "
               "(the last group may be short); cut each row to in_features (an odd one leaves a padding nibble); "
               "float32 out")
