"""Prefill's causal attention, one layer: SDPA against the speed layer's kernels, at SmolLM2's attention shapes.

    python benchmarks/prefill_attention.py [--threads 2] [--heads 9 3] [--shapes 64x64 480x480 512x1000 2048x2048]

For T queries, the last T of S positions (T = S: a prompt's first chunk; T < S: a chunk after cached ones), q, k and v
as a model hands them (views of a [1, T, heads, 64] tensor, heads 9 and 3 K/V heads by default: SmolLM2-135M's):

    bfloat16   SDPA (``minillm.model.sdpa_attention``, its flash kernel)   kernels.causal_attention_bf16 (pairs of
                                                                            bfloat16s: AMX tiles, or AVX512-BF16),
                                                                            kernels.causal_attention (float32 sums)
    float32    SDPA                                                         kernels.causal_attention (C)

Prints the median ms of 15 calls after 3 untimed ones, each candidate taking turns with SDPA, and their ratio. The
pairs' row needs a CPU with AVX512-BF16 (skipped elsewhere).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from minillm.fast import kernels
from minillm.model import sdpa_attention


def shape(text: str) -> tuple[int, int]:
    t, s = (int(n) for n in text.split("x"))
    if not 0 < t <= s:
        raise argparse.ArgumentTypeError(f"{text!r}: want TxS with 0 < T <= S, such as 480x480")
    return t, s


def median_ms(call, reps: int = 15) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HEADS", "KV_HEADS"))
    parser.add_argument("--shapes", type=shape, nargs="+", default=[shape(s) for s in (
        "64x64", "128x128", "480x480", "32x500", "512x1000", "2048x2048")])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads = args.heads
    kinds = [(torch.bfloat16, kernels.causal_attention), (torch.float32, kernels.causal_attention)]
    if kernels.bf16_dot_instructions():
        kinds.insert(0, (torch.bfloat16, kernels.causal_attention_bf16))
    print(f"{heads} heads, {kv_heads} K/V heads, head_dim 64, {args.threads} threads; load {os.getloadavg()[0]:.1f}")
    print("| dtype | kernel | T x S | SDPA ms | kernel ms | ratio |\n|---|---|---|---|---|---|")
    with torch.inference_mode():
        for dtype, kernel in kinds:
            for T, S in args.shapes:
                q = torch.randn(1, T, heads, 64).to(dtype).transpose(1, 2)
                k, v = (torch.randn(1, S, kv_heads, 64).to(dtype).transpose(1, 2) for _ in range(2))
                sdpa = median_ms(lambda: sdpa_attention(q, k, v, None, 0.125))
                ours = median_ms(lambda: kernel(q, k, v, 0.125))
                name = str(dtype).removeprefix("torch.")
                print(f"| {name} | {kernel.__name__} | {T} x {S} | {sdpa:.3f} | {ours:.3f} | {ours / sdpa:.2f} |")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
