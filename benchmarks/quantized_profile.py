"""Where a quantised decode step's time goes: torch.profiler over a few batch-1 decode steps.

    python benchmarks/quantized_profile.py [--quantize int8|int4] [--steps 8] [--threads N]

Prints the profiler's table (self CPU time per op, top 12) of ``--steps`` decode steps after the
kernels are compiled, and the time inside the compiled kernels against the whole step.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from minillm import KVCache, decode_step, load_model, prefill
from minillm.weights import DEFAULT_MODEL


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantize", choices=["int8", "int4", "none"], default="int8")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu", dtype="float32", quantize=None if args.quantize == "none" else args.quantize)
    prompt = torch.arange(8)[None] + 100
    cache = KVCache.for_model(model, max_seq_len=64)
    token = prefill(model, prompt, cache).argmax(-1)
    token = decode_step(model, token, cache).argmax(-1)  # compiles the kernels
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            token = decode_step(model, token, cache).argmax(-1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
