"""Batch-1 decode ms per step, the default decode path against ``--no-fast`` (the lesson's plain PyTorch), at
SmolLM2-135M (real weights) and the 360M and 1.7B shapes (random weights: benchmarks/model_shapes.py):

    python benchmarks/decode_paths.py --shapes 135m 360m 1.7b --contexts 128 1024 --rounds 3
    python benchmarks/decode_paths.py --shapes 135m 1.7b --dtypes bfloat16 --paths default --rounds 3
    python benchmarks/decode_paths.py --shapes 135m 1.7b --dtypes bfloat16 --paths default compiled no-fast
    python benchmarks/decode_paths.py --shapes 135m 1.7b --dtypes int8 int4 --paths default compiled
    git archive HEAD~1 minillm | tar -x -C /tmp/before      # an earlier tree's default path beside them:
    python benchmarks/decode_paths.py --before /tmp/before

One process per run (what a user's ``minillm generate`` is), the paths alternating within a round and the
rounds interleaved, so a machine that gets busier slows both alike. A run prefills 16 tokens and moves the
cache to ``context`` positions (the rest zeros: a step reads and multiplies every cached position whatever
its value, and a 1024-token prefill of the 1.7B shape takes a minute on one core), then times 3 untimed and
``--steps`` timed decode steps: its number is their median, in wall time, or with one torch thread
(OMP_NUM_THREADS=1, for a busy machine) in the CPU time the thread got, which other processes' turns on
the cores do not inflate (their memory traffic still does). Prints one line a run as
it ends, then a table: each path's ms per round, and the memory floor (weights + KV cache bytes read a
step over the bandwidth ``minillm calibrate`` measured: a copy, the same for every dtype) with the GB/s
the fastest round achieved. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from model_shapes import make_shape  # (benchmarks/ is on sys.path)

from minillm import KVCache, decode_step, load_model, prefill
from minillm.costs import decode_cost, with_weights_bytes
from minillm.hardware import load_calibration

QUANTIZED = ("int8", "int4")  # float32 models with their matrices quantised (minillm.quantize)
PATHS = ("default", "no-fast", "before", "compiled")  # "before": the default path of the source tree --before names;
# "compiled": MINILLM_DECODE_PATH=compile+matvec (its first, untimed step compiles: 30-60 s cold)


def one_run(shape: str, path: str, context: int, dtype: str, steps: int) -> dict:
    """Load the model (the speed layer on but for "no-fast"; "int8" and "int4": float32 quantised), fill the cache,
    time ``steps`` decode steps. Also returns the bytes a step reads (``bytes``)."""
    quantize = dtype if dtype in QUANTIZED else None
    model = load_model("smollm2-135m-instruct" if shape == "135m" else make_shape(shape), device="cpu",
                       dtype="float32" if quantize else dtype, quantize=quantize, fast=path != "no-fast")
    cache = KVCache.for_model(model, max_seq_len=context + 3 + steps)
    token = prefill(model, torch.arange(16) + 100, cache).argmax(-1)
    cache.advance(context - 16)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    times = []
    for _ in range(3 + steps):
        start = clock()
        token = decode_step(model, token, cache).argmax(-1)
        times.append((clock() - start) * 1e3)
    cost = decode_cost(model.config, context + 1, model.embed.weight.element_size())
    return {"shape": shape, "path": path, "context": context, "dtype": dtype, "decode_ms": statistics.median(times[3:]),
            "clock": clock.__name__, "decode_path": model.decode_path, "threads": torch.get_num_threads(),
            "bytes": with_weights_bytes(cost, model.weights_bytes()).bytes}


def floor(n_bytes: float) -> float | None:
    """ms to read ``n_bytes`` at the calibrated bandwidth, or None before ``minillm calibrate``."""
    hw = load_calibration("cpu", torch.float32)
    return None if hw is None else n_bytes / hw.mem_bandwidth * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["135m"], choices=["135m", "360m", "1.7b"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 1024])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", *QUANTIZED])
    parser.add_argument("--paths", nargs="+", default=["default", "no-fast"], choices=PATHS)
    parser.add_argument("--before", metavar="DIR", help="a source tree (holding minillm/) whose default path runs as "
                        "the path 'before' (added to --paths)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--one", nargs=4, metavar=("SHAPE", "PATH", "CONTEXT", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        shape, path, context, dtype = args.one
        print(json.dumps(one_run(shape, path, int(context), dtype, args.steps)))
        return
    if args.before and "before" not in args.paths:
        args.paths.append("before")
    if "before" in args.paths and not args.before:
        parser.error("the path 'before' needs --before DIR")
    print(f"load average {os.getloadavg()}", flush=True)
    results, step_bytes = {}, {}
    for r in range(args.rounds):
        for shape in args.shapes:
            for dtype in args.dtypes:
                for context in args.contexts:
                    for path in args.paths:
                        env = {**os.environ, "PYTHONPATH": args.before} if path == "before" else \
                            {**os.environ, "MINILLM_DECODE_PATH": "compile+matvec"} if path == "compiled" else None
                        run = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one", shape, path,
                                              str(context), dtype], capture_output=True, text=True, check=True, env=env)
                        result = json.loads(run.stdout.strip().splitlines()[-1])
                        results.setdefault((shape, dtype, context, path), []).append(result["decode_ms"])
                        step_bytes[(shape, dtype, context)] = result["bytes"]
                        print(f"round {r + 1}: {result} load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"load average {os.getloadavg()}")
    print("| shape | dtype | context | " + " | ".join(f"{p} ms" for p in args.paths) + " | floor ms (GB/s achieved) |")
    print("|---|---|---|" + "---|" * (len(args.paths) + 1))
    for shape in args.shapes:
        for dtype in args.dtypes:
            for context in args.contexts:
                times = [results[(shape, dtype, context, p)] for p in args.paths]
                cells = [" / ".join(f"{t:.1f}" for t in ts) for ts in times]
                n_bytes, best = step_bytes[(shape, dtype, context)], min(min(ts) for ts in times)
                bound = floor(n_bytes)
                cells.append("-" if bound is None else f"{bound:.1f} ({n_bytes / best / 1e6:.1f})")
                print(f"| {shape} | {dtype} | {context} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
