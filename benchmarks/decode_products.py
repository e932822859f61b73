"""A decode step's matrix products, per dtype and row count: PyTorch's kernels against the C, and which one
the speed layer runs now (minillm.fast.products.few_rows_kernel, with this CPU's rule):

    python benchmarks/decode_products.py --threads 2 --rounds 3              # 135M and 1.7B shapes, 1 and 8 rows
    OMP_NUM_THREADS=1 python benchmarks/decode_products.py --threads 1       # on a busy machine

For SmolLM2-135M's shape (all 30 layers' q|k|v, o, gate|up and down: 106 M weights) and the 1.7B shape
(its first 6 of 24 layers: 403 M weights; a pass reads them from memory either way), in each precision,
1 row (a batch-1 decode step) and 8 (a verify pass, a small batch), the candidates:

    float32    F.linear (MKL), the C loops f32_matvec (up to 8 rows) and f32_rows_matmul (5-128 rows)
    bfloat16   F.linear, oneDNN's product on a weight packed once for it (torch.ops.mkldnn._linear_pointwise
               after _reorder_linear_weight: what inductor's weight packing calls), the C loops bf16_matvec (up to
               8 rows) and, with AVX512-BF16, bf16_rows_matmul (up to 128), and where the CPU has AMX-BF16
               bf16_amx_matmul (the matrix units, the weight in place)
    int8, int4 (minillm.quantize's codes, float32 x) F.linear on the dequantised matrix (the lesson's product),
               torch._weight_int8pack_mm or _weight_int4pack_mm_for_cpu (on a copy in its layout, the same ŵ; up
               to 32 rows), the C loops quantized_matvec (1-3 rows) or quantized_matmul, and where the CPU has
               AMX-INT8 quantized_amx_matmul (the matrix units, x in four int8 digits)

    python benchmarks/decode_products.py --dtypes bfloat16 --rows 1 2 8 32 64 128 256 512   # a server's batches
    python benchmarks/decode_products.py --dtypes int8 int4 --rows 1 8 32 128 512

ms a pass over all the matrices (the best of the rounds' medians, the candidates taking turns, as
benchmarks/kernel_families.py; with one thread the CPU time the thread got, so that other processes' turns
on the cores are not counted, though their memory traffic still is) and the GB/s that is (weight bytes / time; a decode step's floor is these
bytes over the bandwidth ``minillm calibrate`` measures). Prints a markdown table and the load average.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from kernel_families import SHAPES, matrices, race  # (benchmarks/ is on sys.path)
from minillm.bench.arg_types import positive_int
from minillm.fast import kernels
from minillm.fast.choose import few_rows_in_c
from minillm.fast.products import (BF16_ROWS_MATMUL_ROWS, QUANTIZED_MATVEC_MAX_ROWS, QUANTIZED_TILED_MAX_ROWS,
                                   ROWS_MATMUL_ROWS, few_rows_kernel)
from minillm.quantize import GROUP_SIZE, QuantizedLinear, unpack_int4

LAYERS = {"135m": None, "1.7b": 6}  # None: every layer
# torch's int8/int4 weight-packed CPU ops took 6-60x the lesson's product at 8-32 rows (2026-12-05); not timed above
TORCH_PACKED_MAX_ROWS = 32


def candidates(ws: list[torch.Tensor], dtype: torch.dtype, rows: int) -> tuple[dict, dict]:
    """({name: a pass over ws} of PyTorch's kernels, {name: a pass} of the C kernels) for x of ``rows`` rows."""
    if isinstance(ws[0], QuantizedLinear):
        return quantized_candidates(ws, rows)
    xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in ws]
    pytorch, c = {"F.linear": lambda: [F.linear(x, w) for x, w in zip(xs, ws)]}, {}
    if dtype == torch.bfloat16:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
        pytorch["oneDNN packed"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                            for x, p in zip(xs, packed)]
        if rows <= 8:
            c["bf16_matvec"] = lambda: [kernels.bf16_matvec(x, w) for x, w in zip(xs, ws)]
        if kernels.bf16_dot_instructions() and rows <= BF16_ROWS_MATMUL_ROWS[1]:
            c["bf16_rows_matmul"] = lambda: [kernels.bf16_rows_matmul(x, w) for x, w in zip(xs, ws)]
        if kernels.bf16_amx_ready():
            c["bf16_amx_matmul"] = lambda: [kernels.bf16_amx_matmul(x, w) for x, w in zip(xs, ws)]
    else:
        if rows <= 8:
            c["f32_matvec"] = lambda: [kernels.f32_matvec(x, w) for x, w in zip(xs, ws)]
        if ROWS_MATMUL_ROWS[0] <= rows <= ROWS_MATMUL_ROWS[1]:
            c["f32_rows_matmul"] = lambda: [kernels.f32_rows_matmul(x, w) for x, w in zip(xs, ws)]
    return pytorch, c


def quantized_candidates(layers: list[QuantizedLinear], rows: int) -> tuple[dict, dict]:
    """candidates() for int8 or int4 matrices (minillm.quantize's codes), float32 x."""
    xs = [torch.randn(rows, m.in_features) for m in layers]
    codes = [(m.qweight, m.scale, m.zero, m.group_size) for m in layers]
    pytorch = {"dequantize + F.linear": lambda: [F.linear(x, m.dequantize()) for x, m in zip(xs, layers)]}
    if rows <= TORCH_PACKED_MAX_ROWS:
        pytorch.update(torch_packed(layers, xs))
    c = {"quantized_matvec" if rows <= QUANTIZED_MATVEC_MAX_ROWS else "quantized_matmul":
         lambda: [kernels.quantized_matvec(x, *q) if rows <= QUANTIZED_MATVEC_MAX_ROWS
                  else kernels.quantized_matmul(x, *q) for x, q in zip(xs, codes)]}
    if kernels.quantized_amx_ready():
        c["quantized_amx_matmul"] = lambda: [kernels.quantized_amx_matmul(x, *q) for x, q in zip(xs, codes)]
    return pytorch, c


def torch_packed(layers: list[QuantizedLinear], xs: list[torch.Tensor]) -> dict:
    """{name: a pass} of torch's own weight-packed int8 or int4 CPU op."""
    if layers[0].fmt == "int8":
        return {"_weight_int8pack_mm": lambda: [torch._weight_int8pack_mm(x, m.qweight, m.scale)
                                                for x, m in zip(xs, layers)]}
    # torch's layout: ŵ = (q - 8) · scale + offset, offset = (8 - zero) · scale, the same ŵ
    packed = [(torch._convert_weight_to_int4pack_for_cpu(unpack_int4(m.qweight, m.in_features).int(), 1),
               torch.stack((m.scale.t(), ((8 - m.zero.float()) * m.scale).t()), dim=-1).contiguous()) for m in layers]
    return {"_weight_int4pack_mm_for_cpu": lambda: [torch._weight_int4pack_mm_for_cpu(x, p, GROUP_SIZE, sz)
                                                    for x, (p, sz) in zip(xs, packed)]}


def quantized_kernel(rows: int) -> str:
    """The kernel FastQuantizedLinear runs for ``rows`` rows here (every SmolLM2 matrix fits the tiles)."""
    if kernels.quantized_amx_ready():
        return "quantized_amx_matmul"
    if rows <= QUANTIZED_MATVEC_MAX_ROWS:
        return "quantized_matvec"
    return "quantized_matmul" if rows <= QUANTIZED_TILED_MAX_ROWS else "dequantize + F.linear"


def _cell(ms: dict[str, float], names, n_bytes: int) -> str:
    """"name ms (GB/s)" of each candidate named."""
    return ", ".join(f"{k} {ms[k]:.1f} ({n_bytes / ms[k] / 1e6:.1f})" for k in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--rows", nargs="+", type=positive_int, default=[1, 8])
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--reps", type=positive_int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    assert kernels.available(), kernels.unavailable_reason()
    in_c = few_rows_in_c()
    clock = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"{clock}, threads {args.threads}, torch {torch.__version__}, 1-3 float32 rows in C here: {in_c}, "
          f"bf16_matvec with AVX512-BF16: {kernels.bf16_dot_instructions()}, AMX-BF16: {kernels.bf16_amx_ready()}, "
          f"AMX-INT8: {kernels.quantized_amx_ready()}, "
          f"load {os.getloadavg()[0]:.1f}\n")
    print("| shape | dtype | rows | PyTorch ms (GB/s) | C ms (GB/s) | best C / best PyTorch | runs now |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        f32 = matrices(SHAPES[shape], LAYERS[shape])
        for name in args.dtypes:
            dtype = None if name in ("int8", "int4") else getattr(torch, name)
            if name in ("int8", "int4"):
                ws = [QuantizedLinear(w, None, name) for w in f32]
                n_bytes = sum(m.weights_bytes() for m in ws)
            else:
                ws = f32 if dtype == torch.float32 else [w.to(dtype) for w in f32]
                n_bytes = sum(w.numel() * w.element_size() for w in ws)
            for rows in args.rows:
                pytorch, c = candidates(ws, dtype, rows)
                clock = time.thread_time if args.threads == 1 else time.perf_counter
                ms = race(pytorch | c, args.rounds, args.reps, clock)
                ratio = f"{min(ms[k] for k in c) / min(ms[k] for k in pytorch):.2f}" if c else "-"
                amx = dtype == torch.bfloat16 and kernels.bf16_amx_ready() and all(map(kernels.bf16_amx_fits, ws))
                pairs = dtype == torch.bfloat16 and kernels.bf16_dot_instructions()
                now = quantized_kernel(rows) if dtype is None else few_rows_kernel(rows, dtype, in_c, False, amx,
                                                                                   pairs=pairs)
                print(f"| {shape} | {name} | {rows} | {_cell(ms, pytorch, n_bytes)} | {_cell(ms, c, n_bytes) or '-'} "
                      f"| {ratio} | {now} |", flush=True)
            del ws
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
