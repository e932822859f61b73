"""Decode's matrix products, faster: ``nn.Linear`` subclasses with the same parameters.

A decode step multiplies one row per sequence by every matrix: the time goes into reading
the matrix from memory, and MKL reads a few-row product with one CPU core, which cannot
stream memory as fast as all the cores together. Two ways around it, for CPU float32:

- :class:`SplitLinear`: a product of at most SPLIT_MAX_ROWS rows is cut into n column blocks
  of the matrix (n threads), run as one batched matmul (a block per thread)::

      x @ Wᵀ  =  [ x @ Wᵀ[:, block 0] | x @ Wᵀ[:, block 1] | ... ]      (views, no copies)

  On 2 cores this took a SmolLM2-135M decode step from 43.1 to 36.2 ms at batch 1 and from
  103 to 71 ms at batch 8 (BENCHMARKS-HISTORY.md); a step of 30 decodes on the paged engine took
  271 -> 222 ms.
- :class:`MatvecLinear`: up to MATVEC_MAX_ROWS rows, a C loop (:mod:`minillm.fast.kernels`) gives
  each thread a share of the matrix's rows and reads each weight once for all of x's rows; it is
  also an op a compiled step calls (inductor's own code for the product is slower). Row-major
  weights only. 1-3 float32 rows only where the decode path's rule says (an AMD CPU: on the Intel
  Xeon MKL's product of so few rows is faster); one or two bfloat16 rows too (in C, faster than F.linear's), up to
  MATVEC_MAX_ROWS on an AMD CPU, where with AVX512-BF16 9-128 rows lie along the vectors' lanes
  (:func:`minillm.fast.kernels.bf16_rows_matmul`).
  Where the CPU has matrix units (Intel AMX), 1-BF16_AMX_MAX_ROWS bfloat16 rows run on them instead, the weight
  read in place as the tiles' A operand (:func:`minillm.fast.kernels.bf16_amx_matmul`): F.linear hands oneDNN
  the weight as its B operand, which it reorders at every call.
  :func:`few_rows_kernel` is the rule, as a table. Above, up to PANEL_MAX_ROWS (a serving step's decodes, a
  short prefill chunk), in a server that asked for it (``panels``, set by :func:`minillm.fast.packing.pack_panels`:
  ``minillm serve --pack-weights``), a C GEMM micro-kernel on a copy of the matrix packed once into panels of
  outputs (csrc/products.c): MKL repacks the matrix at every call, which at 9-40 rows costs more than the
  product. The copy doubles the weights' memory, so a server makes it only when asked.

:class:`FastQuantizedLinear` does the same for :class:`~minillm.quantize.QuantizedLinear`, in C
(:mod:`minillm.fast.kernels`), by the number of rows::

    rows 1-3        quantized_matvec             each code read once, widened to float once a row;
                                                 one row with AVX512-VNNI (AMD Zen 4, an Intel
                                                 Xeon from Cascade Lake): x as four int8 digits by the codes,
                                                 float32's precision (csrc/quantized_vnni.c)
    rows 4-128      quantized_matmul             a tile of the matrix dequantised once (L1-sized),
                    (a serving step's decodes)   then multiplied with every row: no float matrix;
                                                 in a server (``panels``), quantized_panel_matmul:
                                                 the panel micro-kernel on a copy of the codes in
                                                 panels, dequantised in registers (SmolLM2's 120
                                                 matrices at 32 rows: int8 41.2 -> 25.1 ms)
    more (prefill)  dequantize + F.linear        the whole float matrix, one MKL product

except where the CPU has matrix units for int8 (Intel AMX-INT8): there int8 and int4 products of any number of
rows run on them, x written as four int8 digits, float32's precision
(:func:`minillm.fast.kernels.quantized_amx_matmul`; SmolLM2-135M's matrices at 1, 8, 32 and 512 rows: int8 7.2, 9.5,
16.6 and 164 ms against the table's 10.5, 20.0, 53.5 and 434, int4 9.0, 12.1, 24.9 and 327 against 12.4, 19.4,
43.5 and 552; BENCHMARKS.md, "Quantised products on the matrix units"). On CUDA int8 runs
``torch._weight_int8pack_mm``.

Everything else (prefill's many rows, a GPU, float16, autograd) runs ``F.linear``, which
already spreads a big product over every core. Same values as ``F.linear`` up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quantize import QuantizedLinear
from . import kernels

SPLIT_MAX_ROWS = 64  # decode rows (one per sequence); above, MKL's own threading of a product wins
MATVEC_MAX_ROWS = 8  # a decode step's or a speculative verify pass's rows: no packed copy needed
BF16_C_ROWS = 2  # bfloat16 rows the C tile multiplies faster than F.linear (few_rows_kernel's table)
BF16_AMX_MAX_ROWS = 256  # bfloat16 rows the matrix units multiply faster with the weight in place (table below)
MKL_FEW_ROWS = 3  # float32 rows MKL's product took faster than the C tile on the Intel Xeon (few_rows_in_c)
PANEL_MAX_ROWS = 256  # a serving step's decodes or a short chunk; above, MKL's product is as fast
BF16_ROWS_MATMUL_ROWS = (9, 128)  # bfloat16 rows bf16_rows_matmul takes where few_rows_in_c and pairs (its table)
ROWS_MATMUL_ROWS = (5, 128)  # float32 rows f32_rows_matmul takes where few_rows_in_c (an AMD CPU), measured there:
#   SmolLM2-135M's 121 matrices (2 threads, 2026-12-06), ms for all: rows       4     8    16    32    64   128
#   F.linear 62.4 56.1 67.4 89.9 133 224; f32_matvec 29.5 41.0 63.9 109; f32_rows_matmul 30.8 32.0 32.2 54.3 105 211
# measured (SmolLM2-135M's 120 decoder matrices out of cache, 2 threads, Intel Xeon with AVX-512,
# 2026-12-03; the panels' table in csrc/products.c has more row counts), ms for all:
#   rows        1     8    16    32    40   128   256   512
#   F.linear  15.6  33.3  35.9  40.2  43.6  89.8   160   279
#   C loop    17.9  24.4  39.3  76.2
#   panels    14.9  20.0  22.1  26.9  29.6  72.9   143   285
# measured (benchmarks/quantized_batches.py, SmolLM2's shapes): at 3 rows the two kernels are within 10 % either
# way, at 4 the tiled one is faster; at 128 rows MKL's product of the unpacked matrix is as fast (for the LM head
# slower), at 256 faster
QUANTIZED_MATVEC_MAX_ROWS = 3  # above, a tile dequantised once for every row beats widening each code a row
QUANTIZED_TILED_MAX_ROWS = 128  # above, the codes are unpacked once to float for one float product
PRODUCTS = ("linear", "split", "matvec")


def _few_rows(x: torch.Tensor, weight: torch.Tensor, max_rows: int, dtypes=(torch.float32,)) -> int | None:
    """The rows of x when a faster product applies to x @ weightᵀ (a CPU, x and weight of one of ``dtypes``,
    no autograd), else None."""
    if (x.device.type != "cpu" or x.dtype not in dtypes or weight.dtype != x.dtype or weight.dim() != 2
            or weight.shape[1] != x.shape[-1] or x.shape[-1] == 0
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None  # (and F.linear's own errors for a bad dtype or shape)
    rows = x.numel() // x.shape[-1]
    return rows if 0 < rows <= max_rows else None


def few_rows_kernel(rows: int, dtype: torch.dtype, few_rows_in_c: bool, panels: bool, amx: bool = False,
                    compiled: bool = False, pairs: bool = False) -> str:
    """The kernel :class:`MatvecLinear` multiplies ``rows`` rows of ``dtype`` by (on a CPU, the C kernels
    built; autograd and other devices take F.linear, and ``compiled`` code the kernels that are torch ops), the
    first line from the top that matches:

        dtype      rows      kernel
        float32    5-128     "f32_rows_matmul" where ``few_rows_in_c``, without ``panels``, not ``compiled``
        float32    1-3       "f32_matvec" where ``few_rows_in_c``, else "F.linear"
        float32    4-8       "f32_matvec"
        float32    9-256     "f32_panel_matmul" with ``panels`` (a server's batches), else "F.linear"
        bfloat16   1-256     "bf16_amx_matmul" where ``amx`` (the matrix units run here, the weight fits their tiles)
        bfloat16   9-128     "bf16_rows_matmul" elsewhere where ``few_rows_in_c`` and ``pairs``, not ``compiled``
        bfloat16   1-8       "bf16_matvec" elsewhere where ``few_rows_in_c``
        bfloat16   1-2       "bf16_matvec" elsewhere
        any        more      "F.linear"

    ``few_rows_in_c`` is the decode path's rule (:func:`minillm.fast.choose.few_rows_in_c`): at 1-3 float32
    rows MKL's product beat the C loop on an Intel Xeon (the C took 1.02-1.15x its time) and lost to it on an
    AMD EPYC; from 4 rows the C won on both (0.47-0.90x MKL's time on the Xeon). From 5 rows on the AMD EPYC, x's
    rows along the vectors' lanes (:func:`minillm.fast.kernels.f32_rows_matmul`) took 0.48-0.94x MKL's time at 8-128
    rows, where its product and the C loop multiplied at ~80 GFLOP/s of the CPU's 190 (ROWS_MATMUL_ROWS). In
    bfloat16 the C loop took 0.64-0.76x F.linear's time at one row and 0.85-0.88x at two, 0.91-1.04x at three and
    0.96-1.17x at four on the Intel Xeon, its multiply-adds then the bound (BENCHMARKS.md, "Decode products: PyTorch
    against the C"); on the AMD EPYC 0.76-0.86x at 3-8 rows, SmolLM2-135M's and the 1.7B shape's matrices (oneDNN's
    bfloat16 kernels run slower there: BENCHMARKS.md, "The AMD EPYC, again"). With AVX512-BF16's dot products
    (``pairs``: :func:`minillm.fast.kernels.bf16_dot_instructions`) and x's rows along the lanes
    (:func:`minillm.fast.kernels.bf16_rows_matmul`) the AMD EPYC took 0.55-0.94x F.linear's time at 9-128 rows
    (SmolLM2-135M's matrices), where bf16_matvec, which fetches the next tile's rows ahead, still wins at 1-8
    (0.41-0.49x F.linear's; BF16_ROWS_MATMUL_ROWS; BENCHMARKS.md, "The AMD EPYC, a third time").
    On the matrix units with the weight in place (:func:`minillm.fast.kernels.bf16_amx_matmul`), SmolLM2-135M's
    matrices took 0.52-0.83x F.linear's time at 1-256 rows (the 1.7B shape's 0.69-0.92x) and 1.05-1.10x at 512,
    where oneDNN's reorder of the weight is paid back (BENCHMARKS.md, "bfloat16 products on the matrix units").
    """
    if dtype == torch.bfloat16:
        if amx and rows <= BF16_AMX_MAX_ROWS:
            return "bf16_amx_matmul"
        if few_rows_in_c and pairs and not compiled and BF16_ROWS_MATMUL_ROWS[0] <= rows <= BF16_ROWS_MATMUL_ROWS[1]:
            return "bf16_rows_matmul"
        return "bf16_matvec" if rows <= (MATVEC_MAX_ROWS if few_rows_in_c else BF16_C_ROWS) else "F.linear"
    if dtype != torch.float32:
        return "F.linear"
    if few_rows_in_c and not (panels or compiled) and ROWS_MATMUL_ROWS[0] <= rows <= ROWS_MATMUL_ROWS[1]:
        return "f32_rows_matmul"
    if rows <= MATVEC_MAX_ROWS:
        return "f32_matvec" if rows > MKL_FEW_ROWS or few_rows_in_c else "F.linear"
    return "f32_panel_matmul" if panels and rows <= PANEL_MAX_ROWS else "F.linear"


def _stamp(*tensors: torch.Tensor | None) -> tuple:
    """What a packed copy was made from: each tensor (not None) with its version (0 for an inference
    tensor, which cannot be edited); another tensor or an in-place edit makes the copy stale."""
    return tuple((t, 0 if t.is_inference() else t._version) for t in tensors if t is not None)


def _same(stamp: tuple, other: tuple) -> bool:
    return len(stamp) == len(other) and all(t is u and v == w for (t, v), (u, w) in zip(stamp, other))


def split_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weightᵀ + bias with the matrix cut into one column block per thread (see the module docstring)."""
    rows = _few_rows(x, weight, SPLIT_MAX_ROWS)
    if rows is None or torch.compiler.is_compiling():  # (inductor's bmm is slower; get_num_threads breaks a graph)
        return F.linear(x, weight, bias)
    n, out = torch.get_num_threads(), weight.shape[0]
    if n == 1 or out % n:
        return F.linear(x, weight, bias)
    blocks = weight.t().unflatten(1, (n, out // n)).transpose(0, 1)  # [n, in, out/n]
    y = torch.bmm(x.reshape(1, rows, -1).expand(n, -1, -1), blocks)  # [n, rows, out/n]
    y = y.transpose(0, 1).reshape(*x.shape[:-1], out)
    return y if bias is None else y + bias


class SplitLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) computed by :func:`split_product`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_product(x, self.weight, self.bias)


class MatvecLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) computed by the kernel :func:`few_rows_kernel`
    names: F.linear, or the C loop over a few rows (float32, bfloat16), or bfloat16 rows on the matrix units
    (AMX, the weight in place), or (``panels``: a server's batches) the C micro-kernel on a packed copy of the
    matrix; F.linear for other dtypes, devices, autograd, a matrix that is not row-major, compiled code (but the
    float32 C loop, a torch op there) or no C kernels."""

    panels: bool = False  # products of more than MATVEC_MAX_ROWS rows on a packed copy
    few_rows_in_c: bool = False  # 1-3 float32 rows by the C loop (the decode path's rule sets it)
    _panels: tuple | None = None  # (the _stamp of the weight it was packed from, the packed copy)

    def kernel(self, x: torch.Tensor) -> str:
        """The kernel :meth:`forward` multiplies x by: :func:`few_rows_kernel`'s name, or "F.linear" where none of
        the C kernels takes x (another dtype or device, autograd, too many rows, a matrix that is not row-major)."""
        if x.dtype == torch.float32 and not self.few_rows_in_c and x.numel() <= MKL_FEW_ROWS * x.shape[-1]:
            return "F.linear"  # (the table's answer for 1-3 float32 rows, its checks skipped)
        rows = _few_rows(x, self.weight, max(PANEL_MAX_ROWS, BF16_AMX_MAX_ROWS), (torch.float32, torch.bfloat16))
        if rows is None or not self.weight.is_contiguous() or not kernels.available():
            return "F.linear"
        compiling = torch.compiler.is_compiling()
        amx = (x.dtype == torch.bfloat16 and kernels.bf16_amx_fits(self.weight) and kernels.bf16_amx_ready()
               and (self.bias is None or self.bias.dtype == x.dtype))
        pairs = x.dtype == torch.bfloat16 and self.in_features % 2 == 0 and kernels.bf16_dot_instructions()
        return few_rows_kernel(rows, x.dtype, self.few_rows_in_c, self.panels and not compiling, amx, compiling, pairs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel(x)
        if kernel == "F.linear":
            return F.linear(x, self.weight, self.bias)
        rows, compiling = x.numel() // x.shape[-1], torch.compiler.is_compiling()
        if kernel == "bf16_amx_matmul":  # (the bias inside its one rounding; _few_rows made the kernel's checks)
            if compiling:  # (the op: a graph cannot call ctypes)
                y = kernels.functions().bf16_amx_matmul(x.reshape(rows, -1), self.weight, self.bias)
            else:
                bias32 = None if self.bias is None else self.bias.float()
                y = kernels.bf16_amx_unchecked(x.reshape(rows, -1), self.weight, bias32)
            return y.view(*x.shape[:-1], -1)
        if kernel == "f32_matvec":
            y = kernels.functions().f32_matvec(x.reshape(rows, -1), self.weight)
        elif kernel == "bf16_matvec" and not compiling and self.bias is None:
            # (with a bias, F.linear: the kernel rounds its sums to bfloat16, and a bias added after them
            # would round twice, 0.5-0.67 units of bfloat16 from F.linear's one rounding; Qwen2's q|k|v)
            y = kernels.bf16_matvec(x.reshape(rows, -1), self.weight)
        elif kernel == "bf16_rows_matmul" and self.bias is None:  # (a bias: as bf16_matvec's)
            y = kernels.bf16_rows_matmul(x.reshape(rows, -1), self.weight)
        elif kernel == "f32_panel_matmul":
            y = kernels.f32_panel_matmul(x.reshape(rows, -1), self._packed_weight())
        elif kernel == "f32_rows_matmul":
            y = kernels.f32_rows_matmul(x.reshape(rows, -1), self.weight)
        else:
            return F.linear(x, self.weight, self.bias)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _packed_weight(self) -> kernels.Panels:
        """The matrix in panels, packed again when the weight is another tensor or was edited."""
        stamp = _stamp(self.weight)
        if self._panels is None or not _same(self._panels[0], stamp):
            self._panels = (stamp, kernels.f32_pack_panels(self.weight.detach()))
        return self._panels[1]


LINEARS = {"linear": nn.Linear, "split": SplitLinear, "matvec": MatvecLinear}


class FastQuantizedLinear(QuantizedLinear):
    """:class:`~minillm.quantize.QuantizedLinear` (same buffers) with its products in C on a CPU.

    Decode (at most QUANTIZED_TILED_MAX_ROWS rows: one a sequence) reads only the packed bytes: a
    fused dequantise-multiply-reduce for up to three rows, a tile of the matrix dequantised once for
    all rows above (the module docstring's table); prefill (many rows, compute-bound) unpacks the
    float matrix in one pass and runs one float product. int8 and int4 on a CPU with AMX-INT8 run every
    row count on the matrix units instead. The C kernels need float32 on a CPU and (int4) whole groups of a
    multiple of 16; elsewhere the reference path runs.
    """

    panels: bool = False  # (a server's batches) 4-128 rows on a copy of the codes in panels
    _panels: tuple | None = None  # (the _stamp of the tensors it was packed from, the packed copy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if x.is_cuda and self.fmt == "int8":
            y = torch._weight_int8pack_mm(x.reshape(rows, -1), self.qweight, self.scale.to(x.dtype))
        elif not self._kernels_apply(x):
            return self.forward_reference(x)
        elif rows == 0 and x.shape[-1] == self.in_features:  # (a prompt's prefill chunk before its last asks the
            # LM head for no logits)
            return x.new_empty(*x.shape[:-1], self.out_features)
        elif rows <= QUANTIZED_TILED_MAX_ROWS or self._on_matrix_units():
            y = self._product(x.reshape(rows, x.shape[-1]))
        else:
            return F.linear(x, self._unpacked(), self.bias)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _kernels_apply(self, x: torch.Tensor) -> bool:
        fits = self.fmt == "int8" or (self.group_size % 16 == 0 and self.in_features % self.group_size == 0)
        return fits and x.is_cpu and x.dtype == torch.float32 and kernels.available()

    def _on_matrix_units(self) -> bool:
        """Whether products of any number of rows run on the matrix units: the CPU has AMX-INT8."""
        group = self.group_size if self.fmt == "int4" else None
        return kernels.quantized_amx_fits(self.qweight, group) and kernels.quantized_amx_ready()

    def runs_matvec(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` multiplies x by :func:`~minillm.fast.kernels.quantized_matvec`: the C kernels
        apply, 1-QUANTIZED_MATVEC_MAX_ROWS rows, and the CPU has no matrix units for int8."""
        return (self._kernels_apply(x) and 0 < x.numel() <= QUANTIZED_MATVEC_MAX_ROWS * x.shape[-1]
                and not self._on_matrix_units())

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self._on_matrix_units():
            if torch.compiler.is_compiling():  # (the op: a graph cannot call ctypes)
                product = kernels.functions().quantized_amx_matmul
            else:  # (the kernel's checks made by the format, but x's width)
                checked = x.shape[1] != self.in_features
                product = kernels.quantized_amx_matmul if checked else kernels.quantized_amx_unchecked
            return product(x, self.qweight, self.scale, self.zero, self.group_size)
        k = kernels.functions()
        if x.shape[0] <= QUANTIZED_MATVEC_MAX_ROWS:
            return k.quantized_matvec(x, self.qweight, self.scale, self.zero, self.group_size)
        if self.panels and not torch.compiler.is_compiling() and kernels.quantized_panels_vectorised():
            return kernels.quantized_panel_matmul(x, self._packed_codes())
        return k.quantized_matmul(x, self.qweight, self.scale, self.zero, self.group_size)

    def _packed_codes(self) -> kernels.QuantizedPanels:
        """The codes in panels, packed again when the codes, scales or zero points are other tensors or
        were edited."""
        zero = self.zero if self.fmt == "int4" else None
        stamp = _stamp(self.qweight, self.scale, zero)
        if self._panels is None or not _same(self._panels[0], stamp):
            group = self.group_size if self.fmt == "int4" else None
            self._panels = (stamp, kernels.quantized_pack_panels(self.qweight, self.scale, zero, group))
        return self._panels[1]

    def _unpacked(self) -> torch.Tensor:
        return kernels.functions().dequantize(self.qweight, self.scale, self.zero, self.group_size)


def swap_class(module: nn.Module, cls: type) -> nn.Module:
    """Make ``module`` an instance of ``cls``, a subclass of its course class with only new methods:
    its parameters, buffers, children and names stay the very same objects (checkpoints, prefix-cache
    fingerprints and in-place edits see no difference). Returns the module."""
    module.__class__ = cls
    return module
