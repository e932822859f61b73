"""A serving engine's decode-only step, replayed (minillm/fast/replay_serving.py) against the eager forward.

    python benchmarks/serving_step_replay.py [--dtypes float32 bfloat16] [--batches 1 8 32] [--rounds 4] [--steps 5]

For each dtype and batch size B: SmolLM2-135M on the CPU, an ``LLMEngine`` with the bench-serving defaults (block
size 16, budget 512 tokens, the allocator ``minillm serve`` sets), B greedy requests with prompts drawn uniform
32-512 (seed 0), prefilled until all decode; then the two variants take turns (``model.replayed_batch`` set, or
None: the eager ``forward_batch``), ``--rounds`` times one untimed step and ``--steps`` timed steps each. Prints
the median and the fastest step of each, in ms, their ratio, and the load average. No hooks are registered (the
replay runs the eager forward under one): the step is timed whole, ``engine.step()``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from minillm import load_model
from minillm.bench.arg_types import positive_int
from minillm.malloc_policy import keep_freed_memory, use_huge_pages_for_pools
from minillm.sampling import SamplingParams
from minillm.serving.engine import LLMEngine

MAX_PROMPT, BLOCK_SIZE = 512, 16  # prompts drawn uniform 32-512 tokens; the bench-serving block size


def decoding_engine(model, batch: int, seed: int, new_tokens: int) -> LLMEngine:
    """An engine whose ``batch`` requests have all been prefilled: each of its next ``new_tokens`` steps decodes
    them all (its pool holds every request's longest prompt and those tokens: none is preempted)."""
    rng = random.Random(seed)
    blocks_each = -(-(MAX_PROMPT + new_tokens + 1) // BLOCK_SIZE)
    engine = LLMEngine(model, max_num_seqs=batch, num_blocks=batch * blocks_each + 1, block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_new_tokens=4096, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(model.config.vocab_size) for _ in range(rng.randint(32, MAX_PROMPT))], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    return engine


def time_variants(model, engine: LLMEngine, rounds: int, steps: int) -> dict[str, list[float]]:
    """ms of each timed step, per variant, the variants taking turns on the same engine."""
    replayed, times = model.replayed_batch, {"replayed": [], "eager": []}
    for _ in range(rounds):
        for name, step in (("replayed", replayed), ("eager", None)):
            model.replayed_batch = step
            engine.step()  # (untimed: a new plan, or the eager path's first step since)
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times[name].append((time.perf_counter() - start) * 1e3)
    model.replayed_batch = replayed
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"],
                        help="the model's precisions, one table row per dtype and batch")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32],
                        help="requests decoding together in each timed step")
    parser.add_argument("--rounds", type=positive_int, default=4, help="turns each variant takes, interleaved")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps a variant's turn")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch's threads (the CPU's cores at most)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' lengths and tokens")
    args = parser.parse_args()
    if args.threads > (os.cpu_count() or 1):
        parser.error(f"--threads {args.threads} is more than this machine's {os.cpu_count()} CPUs; give at most that")
    keep_freed_memory()
    use_huge_pages_for_pools()
    torch.set_num_threads(args.threads)
    print(f"load average before {_load()}")
    print("| dtype | batch | replayed ms (median / min) | eager ms (median / min) | replayed / eager |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes:
        model = load_model("smollm2-135m-instruct", device="cpu", dtype=dtype)
        if model.replayed_batch is None:
            raise SystemExit(f"the decode path is {model.decode_path!r}: no replayed serving step to time (do the C "
                             "kernels build? is MINILLM_DECODE_PATH set?)")
        for batch in args.batches:
            engine = decoding_engine(model, batch, args.seed, args.rounds * 2 * (args.steps + 1))
            times = time_variants(model, engine, args.rounds, args.steps)
            r, e = (statistics.median(times[k]) for k in ("replayed", "eager"))
            print(f"| {dtype} | {batch} | {r:.1f} / {min(times['replayed']):.1f} | {e:.1f} / {min(times['eager']):.1f} "
                  f"| {r / e:.2f} |")
    print(f"load average after {_load()}")


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
