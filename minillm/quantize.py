"""Weight-only quantisation: int8 and int4 matrices, dequantised on the fly, activations stay float.

A decode step reads every weight once to produce one token (lesson 05): it is memory-bound, so
storing each weight in fewer bytes moves the floor down. Two formats, as the field stores them:

    int8, per output channel, symmetric          int4, per group of the input dim, asymmetric
    (LLM.int8's vector-wise scale, absmax)        (GPTQ / AWQ; llama.cpp Q4_1 stores a min, not a zero)

    scale[o] = max_i |w[o, i]| / 127              lo = min(0, min_g w), hi = max(0, max_g w)
    q[o, i]  = round(w[o, i] / scale[o])          scale = (hi - lo) / 15, zero = round(-lo / scale)
             in [-127, 127], int8                 q = clamp(round(w / scale) + zero, 0, 15)
    w ≈ q · scale[o]                              w ≈ (q - zero) · scale            per group g
    1 byte a weight + 4 bytes a row               ½ byte a weight + 5 bytes a group (float32 scale,
                                                  uint8 zero): 0.578 bytes a weight at group 64

The int4 range includes 0 (GPTQ's ``Quantizer.find_params`` does the same), so 0 is exact and an
all-positive group gets zero = 0, an all-negative one zero = 15. Two int4 codes share a byte:

    byte j of a row = q[2j] | q[2j+1] << 4          (element 2j in the low nibble)

The last group of a row is shorter when in_features % group_size != 0; its scale and zero come
from its own values. Rounding to the nearest code bounds the error: |w - ŵ| <= scale / 2.

:meth:`QuantizedLinear.forward` multiplies x [.., in] by a quantised matrix [out, in] as the
arithmetic is written: ``F.linear(x, dequantize(...))``. It writes a float matrix as large as the
original every call, so on its own it saves no bytes: the speed layer (:mod:`minillm.fast.products`,
``FastQuantizedLinear``) swaps in C loops that read only the packed bytes, same values up to float
rounding.

Only the transformer's matrices are quantised; the embedding and the norms stay float. A tied
LM head (SmolLM2) gets its own quantised copy, the lookup keeps reading the float table: the
copy costs memory (int8: 28 MB for SmolLM2's 49152×576 head) but a decode step reads the copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import MiniLLMError

FORMATS = ("int8", "int4")
GROUP_SIZE = 64  # int4 weights per scale and zero (GPTQ's and AWQ's usual; the C kernel needs a multiple of 16)


class QuantizationError(MiniLLMError, ValueError):
    """An unknown format, or a model that cannot be quantised as asked."""


# -- the formats ---------------------------------------------------------------------


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w [out, in] float -> (q [out, in] int8, scale [out] float32).

    scale[o] = max|w[o]| / 127 (1 for an all-zero row); q = round(w / scale) in [-127, 127].
    Dequantise with :func:`dequantize_int8`; |w - ŵ| <= scale[o] / 2.
    """
    w = w.float().contiguous()  # row-major codes, whatever the float layout (minillm.fast may transpose)
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """ŵ = q · scale, per row: q [out, in] int8, scale [out] -> [out, in] float32."""
    return q.float() * scale[:, None]


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
    out, n_in = w.shape
    groups = _groups(w.float().contiguous(), group_size)  # [out, n_groups, group_size], the short group padded
    lo, hi = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)  # 0 inside: exact, and the
    scale = (hi - lo) / 15  # short group's padding zeros change nothing
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_int4(q.view(out, -1)[:, :n_in]), scale, zero.to(torch.uint8)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int,
                    group_size: int = GROUP_SIZE) -> torch.Tensor:
    """ŵ = (q - zero) · scale per group: the inverse of :func:`quantize_int4`, [out, in_features] float32."""
    q = unpack_int4(packed, in_features).float()
    groups = _groups(q, group_size)
    w = (groups - zero[..., None].float()) * scale[..., None]
    return w.view(q.shape[0], -1)[:, :in_features]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: q [out, in] uint8 in 0..15 -> [out, ceil(in/2)] uint8.

    byte j = q[2j] | q[2j+1] << 4 (element 2j in the low nibble, as llama.cpp's and GPTQ's
    little-endian packings put the earlier element in the lower bits). An odd ``in`` is padded with 0.
    """
    if q.shape[1] % 2:
        q = F.pad(q, (0, 1))
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: [out, ceil(in/2)] uint8 -> q [out, in_features] uint8."""
    low, high = packed & 15, packed >> 4
    return torch.stack((low, high), dim=-1).view(packed.shape[0], -1)[:, :in_features]


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] -> [out, n_groups, group_size], the last group padded with zeros."""
    pad = -w.shape[1] % group_size
    return F.pad(w, (0, pad)).view(w.shape[0], -1, group_size)


def quantized_bytes(out_features: int, in_features: int, fmt: str, group_size: int = GROUP_SIZE) -> int:
    """Bytes of one quantised [out, in] matrix with its scales (and zeros), bias not included.

    int8: out·in (int8) + out·4 (float32 scales).
    int4: out·ceil(in/2) (packed) + out·n_groups·(4 + 1) (float32 scale, uint8 zero per group).
    """
    _check_format(fmt)
    if fmt == "int8":
        return out_features * in_features + out_features * 4
    n_groups = -(-in_features // group_size)
    return out_features * -(-in_features // 2) + out_features * n_groups * 5


def check_quantize_args(quantize, device, dtype) -> None:
    """Refuse, before loading anything, a format that does not exist or a dtype the CPU kernels cannot read.

    Raises QuantizationError naming the problem and the fix.
    """
    if quantize is None:
        return
    _check_format(quantize)
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type != "cuda" and dtype not in (None, "float32", torch.float32):
        raise QuantizationError(f"quantize={quantize!r} needs dtype float32 on {device_type} (got {dtype}): the "
                                f"activations stay float32 and the kernels read them; drop the dtype")


def _check_format(fmt) -> None:
    if fmt not in FORMATS:
        raise QuantizationError(f"quantize must be one of {', '.join(FORMATS)}, got {fmt!r}")


# -- the module --------------------------------------------------------------------------


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored int8 or int4 (see the module docstring).

    Buffers: ``qweight`` (int8 [out, in] or uint8 [out, ceil(in/2)]), ``scale`` (float32 [out] or
    [out, n_groups]), ``zero`` (uint8 [out, n_groups], int4 only), ``bias`` (float, or None).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, group_size: int = GROUP_SIZE):
        super().__init__()
        _check_format(fmt)
        self.fmt, self.group_size = fmt, group_size
        self.out_features, self.in_features = weight.shape
        if fmt == "int8":
            q, scale = quantize_int8(weight)
            zero = None
        else:
            q, scale, zero = quantize_int4(weight, group_size)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.fmt == "int4" else ""
        return f"{self.in_features} -> {self.out_features}, {self.fmt}{group}, {self.weights_bytes():,} bytes"

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] these codes stand for: q · scale, or (q - zero) · scale per group."""
        if self.fmt == "int8":
            return dequantize_int8(self.qweight, self.scale)
        return dequantize_int4(self.qweight, self.scale, self.zero, self.in_features, self.group_size)

    def weights_bytes(self) -> int:
        """Bytes a product reads: codes, scales, zeros and bias (equals :func:`quantized_bytes` + bias)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def num_parameters(self) -> int:
        """The weights (and biases) these codes stand for: out · in (+ out)."""
        return self.out_features * self.in_features + (0 if self.bias is None else self.bias.numel())

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype: dequantise the whole matrix, then ``F.linear``."""
        return F.linear(x, self.dequantize().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    forward = forward_reference


# -- a whole model ----------------------------------------------------------------------


def quantize_model(model: nn.Module, fmt: str, group_size: int = GROUP_SIZE) -> nn.Module:
    """Replace every matrix of the blocks and the LM head by a :class:`QuantizedLinear`, in place.

    The embedding and norms stay float; a tied LM head is quantised as a copy. The speed layer
    (:mod:`minillm.fast`) then stacks q|k|v and gate|up as it does float matrices (the codes are per
    output row, so stacking changes none of them) and swaps in the C products.
    Sets ``model.quantization`` to fmt. Returns the model.

    Raises QuantizationError for an unknown format, a model already quantised, or one whose weights
    are not float32 on a CPU (the kernels read float32 activations; on CUDA bfloat16 and float16 are
    accepted too).
    """
    _check_format(fmt)
    weight = model.embed.weight
    if weight.device.type != "cuda" and weight.dtype != torch.float32:
        raise QuantizationError(f"quantize={fmt!r} needs float32 weights on {weight.device.type} "
                                f"(got {str(weight.dtype).removeprefix('torch.')}); load with dtype='float32'")
    if getattr(model, "quantization", None):
        raise QuantizationError(f"the model is already quantised ({model.quantization}); load it again to change")
    for parent in [m for block in model.blocks for m in (block.attn, block.mlp)] + [model]:
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, QuantizedLinear(child.weight, child.bias, fmt, group_size))
    model.quantization = fmt
    return model
