"""Where a batch-1 float32 decode step's time goes, per decode path: matrix products vs the rest.

    python benchmarks/decode_profile.py [--threads 2] [--steps 32] [--paths row-major long-rows+split ...]

For each decode path (minillm/fast/choose.py) on the default model (SmolLM2-135M, float32, CPU):
the measured ms/step (median), the memory floor (weights + KV bytes / the calibrated GB/s), and,
from torch.profiler over the same steps, the ops per step and the CPU time of the matrix
products (aten::mm/addmm/bmm/linear) against everything else (norms, RoPE, attention, adds,
views: the small ops whose dispatch a fused or compiled step saves). Prints one line per path.
Self CPU time sums over threads, so it can exceed the wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minillm import KVCache, decode_step, load_model, prefill
from minillm.costs import decode_cost
from minillm.fast.choose import CANDIDATES, EAGER, apply_decode_path
from minillm.hardware import get_hardware

PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")
CONTEXT = 128


def steps_ms(model, steps: int, prof=None) -> list[float]:
    ids = torch.arange(CONTEXT) % model.config.vocab_size
    cache = KVCache.for_model(model, max_seq_len=CONTEXT + 3 + steps)
    token = prefill(model, ids, cache).argmax(-1)
    times = []
    for i in range(3 + steps):
        if i == 3 and prof is not None:
            prof.start()
        start = time.perf_counter()
        token = decode_step(model, token, cache).argmax(-1)
        times.append((time.perf_counter() - start) * 1e3)
    if prof is not None:
        prof.stop()
    return times[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--paths", nargs="+", default=list(EAGER), choices=list(CANDIDATES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
    hw = get_hardware("cpu", torch.float32)
    floor_ms = decode_cost(model.config, CONTEXT + args.steps // 2, 4).bytes / hw.mem_bandwidth * 1e3
    print(f"SmolLM2-135M float32, batch 1, context {CONTEXT}, {args.threads} threads; memory floor "
          f"{floor_ms:.1f} ms/step at the calibrated {hw.mem_bandwidth / 1e9:.1f} GB/s")
    for name in args.paths:
        apply_decode_path(model, name)
        plain = statistics.median(steps_ms(model, args.steps))
        prof = profile(activities=[ProfilerActivity.CPU])
        steps_ms(model, args.steps, prof)
        events = prof.key_averages()
        n_ops = sum(e.count for e in events if e.key.startswith("aten::")) / args.steps  # nested calls included
        products_ms = sum(e.self_cpu_time_total for e in events if e.key in PRODUCTS) / 1e3 / args.steps
        total_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
        print(f"{name:16s} {plain:6.1f} ms/step ({plain / floor_ms:.2f}x the floor); profiled: {n_ops:,.0f} aten calls/step, "
              f"products {products_ms:.1f} ms, everything else {total_ms - products_ms:.1f} ms (self CPU time)")


if __name__ == "__main__":
    main()
