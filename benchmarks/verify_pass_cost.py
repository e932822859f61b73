#!/usr/bin/env python
# Run: python benchmarks/verify_pass_cost.py THREADS   (why speculation pays only with long acceptances on a CPU)
"""Time of one verify pass over 1 + k tokens vs one decode step, SmolLM2-135M, context 100 (best of 15).

Wall time and this process's CPU time (time.process_time): on a machine shared with other jobs the
CPU time leaves out the time spent waiting for a core, so its ratio stays readable (1 thread)."""
import sys, time, torch
from minillm import KVCache, decode_step, load_model, prefill
from minillm.phases import verify
torch.set_num_threads(int(sys.argv[1]))
model = load_model("smollm2-135m-instruct", device="cpu")
cache = KVCache.for_model(model, max_seq_len=256)
prefill(model, list(range(100, 200)), cache)
def timed(fn, n):
    wall, cpu = [], []
    for _ in range(15):
        cache.truncate(100); t, c = time.perf_counter(), time.process_time(); fn(n)
        wall.append((time.perf_counter() - t) * 1e3); cpu.append((time.process_time() - c) * 1e3)
    return min(wall), min(cpu)
decode_ms, decode_cpu_ms = timed(lambda n: decode_step(model, 5, cache), 1)
flops = lambda n: 2 * model.num_parameters() * n  # the weight products alone (2 FLOPs a weight a row)
print(f"threads {torch.get_num_threads()}: decode step {decode_ms:.1f} ms wall, {decode_cpu_ms:.1f} ms CPU")
for k in (1, 3, 5, 8):
    ms, cpu_ms = timed(lambda n: verify(model, list(range(10, 11 + n)), cache), k)
    print(f"verify 1+{k} tokens: {ms:.1f} ms wall = {ms / decode_ms:.2f} decode steps; {cpu_ms:.1f} ms CPU = "
          f"{cpu_ms / decode_cpu_ms:.2f} decode steps, {flops(k + 1) / cpu_ms / 1e6:.1f} GFLOP/s of CPU time")
