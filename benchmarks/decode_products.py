"""A decode step's matrix products, per dtype and row count: PyTorch's kernels against the C, and which one
the speed layer runs now (minillm.fast.products.few_rows_kernel, with this CPU's rule):

    python benchmarks/decode_products.py --threads 2 --rounds 3              # 135M and 1.7B shapes, 1 and 8 rows
    OMP_NUM_THREADS=1 python benchmarks/decode_products.py --threads 1       # on a busy machine

For SmolLM2-135M's shape (all 30 layers' q|k|v, o, gate|up and down: 106 M weights) and the 1.7B shape
(its first 6 of 24 layers: 403 M weights; a pass reads them from memory either way), float32 and bfloat16,
1 row (a batch-1 decode step) and 8 (a verify pass, a small batch), the candidates:

    float32    F.linear (MKL), the C loop f32_matvec
    bfloat16   F.linear, oneDNN's product on a weight packed once for it (torch.ops.mkldnn._linear_pointwise
               after _reorder_linear_weight: what inductor's weight packing calls), the C loop bf16_matvec

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
from minillm.fast import kernels
from minillm.fast.choose import few_rows_in_c
from minillm.fast.products import few_rows_kernel

LAYERS = {"135m": None, "1.7b": 6}  # None: every layer


def candidates(ws: list[torch.Tensor], dtype: torch.dtype, rows: int) -> tuple[dict, str]:
    """{name: a pass over ws} for x of ``rows`` rows, and the C kernel's name."""
    xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in ws]
    out = {"F.linear": lambda: [F.linear(x, w) for x, w in zip(xs, ws)]}
    if dtype == torch.bfloat16:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
        out["oneDNN packed"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                        for x, p in zip(xs, packed)]
        out["C"], kernel = lambda: [kernels.bf16_matvec(x, w) for x, w in zip(xs, ws)], "bf16_matvec"
    else:
        out["C"], kernel = lambda: [kernels.f32_matvec(x, w) for x, w in zip(xs, ws)], "f32_matvec"
    return out, kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    assert kernels.available(), kernels.unavailable_reason()
    in_c = few_rows_in_c()
    clock = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"{clock}, threads {args.threads}, torch {torch.__version__}, 1-3 float32 rows in C here: {in_c}, bf16_matvec with "
          f"AVX512-BF16: {kernels.bf16_dot_instructions()}, load {os.getloadavg()[0]:.1f}\n")
    print("| shape | dtype | rows | PyTorch ms (GB/s) | C ms (GB/s) | C / best PyTorch | runs now |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        f32 = matrices(SHAPES[shape], LAYERS[shape])
        for name in args.dtypes:
            dtype = getattr(torch, name)
            ws = f32 if dtype == torch.float32 else [w.to(dtype) for w in f32]
            n_bytes = sum(w.numel() * w.element_size() for w in ws)
            for rows in args.rows:
                fns, kernel = candidates(ws, dtype, rows)
                ms = race(fns, args.rounds, args.reps, time.thread_time if args.threads == 1 else time.perf_counter)
                torch_ms = {k: v for k, v in ms.items() if k != "C"}
                cells = ", ".join(f"{k} {v:.1f} ({n_bytes / v / 1e6:.1f})" for k, v in torch_ms.items())
                now = few_rows_kernel(rows, dtype, in_c, panels=False)
                print(f"| {shape} | {name} | {rows} | {cells} | {kernel} {ms['C']:.1f} ({n_bytes / ms['C'] / 1e6:.1f}) "
                      f"| {ms['C'] / min(torch_ms.values()):.2f} | {now} |", flush=True)
            del ws
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
