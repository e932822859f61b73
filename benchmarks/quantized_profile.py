"""Where a quantised decode step's time goes: the products against everything else.

    python benchmarks/quantized_profile.py [--quantize int8|int4|none] [--steps 32] [--threads N]

Times ``--steps`` batch-1 decode steps (median ms) twice, taking turns for 3 rounds: as they run,
and with every quantised product replaced by an empty output of its shape (``torch.empty``: no
arithmetic, no weight read). The difference is the products' time; with the bytes they read it
gives their GB/s. Then torch.profiler's table of the ops of a few steps (self CPU time, top 12:
what "everything else" is; the kernels' ctypes calls do not appear in it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minillm import KVCache, decode_step, load_model, prefill
from minillm.fast import kernels as matvec_kernels
from minillm.formats.weights import DEFAULT_MODEL


def decode_ms(model, steps: int) -> float:
    cache = KVCache.for_model(model, max_seq_len=8 + steps + 1)
    token = prefill(model, torch.arange(8) + 100, cache).argmax(-1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = decode_step(model, token, cache).argmax(-1)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def without_products():
    """Swap the kernels for empty outputs; returns a function that puts them back."""
    real = matvec_kernels.quantized_matvec
    matvec_kernels.quantized_matvec = lambda x, codes, *rest: torch.empty(x.shape[0], codes.shape[0])

    def restore():
        matvec_kernels.quantized_matvec = real

    return restore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantize", choices=["int8", "int4", "none"], default="int8")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fmt = None if args.quantize == "none" else args.quantize
    model = load_model(args.model, device="cpu", dtype="float32", quantize=fmt)
    decode_ms(model, 2)  # builds the kernels
    whole, rest = [], []
    for _ in range(3):
        whole.append(decode_ms(model, args.steps))
        restore = without_products()
        rest.append(decode_ms(model, args.steps))
        restore()
    step, other = min(whole), min(rest)
    print(f"{args.model}, {args.quantize}, batch 1, {args.threads} threads, best of 3 x median of {args.steps} steps")
    if fmt:
        products = step - other
        print(f"decode step {step:.2f} ms = products {products:.2f} ms ({model.weights_bytes() / 1e6:.1f} MB: "
              f"{model.weights_bytes() / products / 1e6:.1f} GB/s) + everything else {other:.2f} ms")
    else:
        print(f"decode step {step:.2f} ms (float32: no quantised products to take out)")
    cache = KVCache.for_model(model, max_seq_len=64)
    token = prefill(model, torch.arange(8) + 100, cache).argmax(-1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            token = decode_step(model, token, cache).argmax(-1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
