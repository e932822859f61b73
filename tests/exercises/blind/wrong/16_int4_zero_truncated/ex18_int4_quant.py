"""Exercise 18: int4 group quantisation: scale, zero point, two codes a byte, and back.

Write ``quantize_int4`` (a float matrix to 4-bit codes, packed two to a byte, with a scale and
a zero point per group of ``group_size`` weights along each row) and ``dequantize_int4`` (back to
floats). Per group, GPTQ's asymmetric scheme, with 0 always inside the range::

    lo = min(0, min w)    hi = max(0, max w)    scale = (hi - lo) / 15   (1 if hi == lo)
    zero = round(-lo / scale)  in 0..15          q = clamp(round(w / scale) + zero, 0, 15)
    ŵ = (q - zero) · scale                       |w - ŵ| <= scale / 2

    row of 6 weights, group_size 4:  [ w0 w1 w2 w3 | w4 w5 ]   2 groups, the last one short
    packed bytes:                    [ q0|q1<<4, q2|q3<<4, q4|q5<<4 ]   (earlier element: low nibble)

Write your own packing (the docstring's :func:`pack_int4` is minillm's).

Check:      minillm check ex18   (or: pytest tests/exercises -m ex18 --impl student)
Lesson:     lessons/09-optimisations.md#weight-only-quantisation
Reference:  minillm.quantize
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401

from minillm.quantize import QuantizationError  # noqa: F401

GROUP_SIZE = 64


def quantize_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group_size`` along the input dim (GPTQ's layout).

    w [out, in] float -> (packed [out, ceil(in/2)] uint8, scale [out, n_groups] float32,
    zero [out, n_groups] uint8), n_groups = ceil(in / group_size); the last group may be short.

    Per group: lo = min(0, min w), hi = max(0, max w), scale = (hi - lo) / 15 (1 when hi == lo == 0),
    zero = round(-lo / scale) in [0, 15], q = clamp(round(w / scale) + zero, 0, 15), packed two
    to a byte with element 2j in the low nibble (:func:`pack_int4`). |w - ŵ| <= scale / 2.
    Raises QuantizationError for a group_size below 2.
    """
    if group_size < 2:
        raise QuantizationError(f"group_size must be >= 2, got {group_size}")
    out_f, in_f = w.shape
    n_groups = (in_f + group_size - 1) // group_size
    wf = w.detach().to(torch.float32)
    wp = F.pad(wf, (0, n_groups * group_size - in_f))
    g = wp.view(out_f, n_groups, group_size)
    lo = g.amin(dim=-1).clamp(max=0)
    hi = g.amax(dim=-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(hi == lo, torch.ones_like(scale), scale)
    zero = (-lo / scale).clamp(0, 15).floor()
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    q = q.view(out_f, n_groups * group_size)[:, :in_f].to(torch.uint8)
    if in_f % 2:
        q = F.pad(q, (0, 1))
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    return packed, scale, zero.to(torch.uint8)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int,
                    group_size: int = GROUP_SIZE) -> torch.Tensor:
    """ŵ = (q - zero) · scale per group: the inverse of :func:`quantize_int4`, [out, in_features] float32."""
    low = packed & 0x0F
    high = packed >> 4
    q = torch.stack([low, high], dim=-1).view(packed.shape[0], -1)[:, :in_features].to(torch.float32)
    s = scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :in_features]
    z = zero.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :in_features]
    return (q - z) * s
