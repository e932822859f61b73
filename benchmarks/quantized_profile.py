"""Where a quantised decode step's time goes: torch.profiler over a few batch-1 decode steps.

    python benchmarks/quantized_profile.py [--quantize int8|int4|none] [--steps 8] [--threads N]

Prints the profiler's table (self CPU time per op, top 12) of ``--steps`` decode steps after the
C kernels are built, and the time inside the kernels (labelled ``quantize_kernels.int8_matvec`` /
``int4_matvec``: the profiler does not see into ctypes calls, so this script wraps them in a
``record_function``) against the whole steps.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from minillm import KVCache, decode_step, load_model, prefill, quantize_kernels
from minillm.weights import DEFAULT_MODEL


def label_kernels() -> None:
    """Wrap each kernel call in a record_function named after it, so the profiler counts it."""
    for name in ("int8_matvec", "int4_matvec"):
        kernel = getattr(quantize_kernels, name)

        def labelled(*args, kernel=kernel, label=f"quantize_kernels.{name}"):
            with record_function(label):
                return kernel(*args)

        setattr(quantize_kernels, name, labelled)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantize", choices=["int8", "int4", "none"], default="int8")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    label_kernels()
    model = load_model(args.model, device="cpu", dtype="float32", quantize=None if args.quantize == "none" else args.quantize)
    prompt = torch.arange(8)[None] + 100
    cache = KVCache.for_model(model, max_seq_len=64)
    token = prefill(model, prompt, cache).argmax(-1)
    token = decode_step(model, token, cache).argmax(-1)  # builds the kernels
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            token = decode_step(model, token, cache).argmax(-1)
    total_ms = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))
    kernel = [e for e in events if e.key.startswith("quantize_kernels.")]
    kernel_ms = sum(e.cpu_time_total for e in kernel) / 1e3
    calls = sum(e.count for e in kernel)
    print(f"{args.steps} decode steps, {total_ms:.1f} ms profiled ({total_ms / args.steps:.1f} ms a step): "
          f"{calls} kernel calls took {kernel_ms:.1f} ms ({100 * kernel_ms / total_ms:.0f} %), "
          f"the rest {total_ms - kernel_ms:.1f} ms")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
