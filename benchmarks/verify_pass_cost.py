#!/usr/bin/env python
# Run: python benchmarks/verify_pass_cost.py THREADS   (why speculation pays only with long acceptances on a CPU)
"""Time of one verify pass over 1 + k tokens vs one decode step, SmolLM2-135M, context 100 (median of 15)."""
import statistics, time, torch
from minillm import KVCache, decode_step, load_model, prefill
from minillm.speculative import verify
import sys; torch.set_num_threads(int(sys.argv[1]))
model = load_model("smollm2-135m-instruct", device="cpu")
cache = KVCache.for_model(model, max_seq_len=256)
prefill(model, list(range(100, 200)), cache)
def timed(fn, n):
    times = []
    for _ in range(15):
        cache.truncate(100); t = time.perf_counter(); fn(n); times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
decode_ms = timed(lambda n: decode_step(model, 5, cache), 1)
print(f"threads {torch.get_num_threads()}: decode step {decode_ms:.1f} ms")
for k in (1, 3, 5, 8):
    ms = timed(lambda n: verify(model, list(range(10, 11 + n)), cache), k)
    print(f"verify 1+{k} tokens: {ms:.1f} ms = {ms / decode_ms:.2f} decode steps")
