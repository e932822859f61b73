"""Decode ms per step of the default model at one context length, in one process: for A/B runs
of two source trees in alternating processes.

    for r in 1 2 3; do for tree in /tmp/before $PWD; do
        PYTHONPATH=$tree OMP_NUM_THREADS=1 MINILLM_DECODE_PATH=matvec python benchmarks/decode_step_ms.py 1024
    done; done

Prints the best and the median of 3 runs, each the median of 30 timed steps after 5 untimed ones.
"""

import statistics
import sys
import time

import torch

from minillm import KVCache, decode_step, load_model, prefill

context = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
model = load_model("smollm2-135m-instruct")
ids = torch.arange(context) % 1000 + 100
runs = []
for _ in range(3):
    cache = KVCache.for_model(model, max_seq_len=context + 40)
    token = prefill(model, ids, cache).argmax(-1)
    times = []
    for _ in range(35):
        start = time.perf_counter()
        token = decode_step(model, token, cache).argmax(-1)
        times.append(time.perf_counter() - start)
    runs.append(statistics.median(times[5:]) * 1e3)
print(f"{model.decode_path} context {context}: best {min(runs):.1f} ms, median {statistics.median(runs):.1f} ms "
      f"({sys.modules['minillm'].__file__})")
