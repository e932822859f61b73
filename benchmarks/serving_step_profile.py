"""Where one serving engine step's time goes, at batch 8/16/32: decode only, and mixed with a prefill chunk.

    python benchmarks/serving_step_profile.py [--batches 8 16 32] [--steps 3] [--rounds 2] [--no-fast] [--clock cpu]
                                              [--dtype bfloat16]

For each batch size B, on the default model (SmolLM2-135M, float32 or ``--dtype bfloat16``, CPU) and an ``LLMEngine`` with
the bench-serving defaults (block size 16, chunked prefill, budget 512 tokens), B requests with
prompts drawn uniform 32-512 (seed 0) are prefilled until all decode, then ``--steps`` engine steps
are timed:

- decode: the B requests decode one token each;
- mixed: prompts of 512 - B tokens arrive (near the workload's longest; one output token each, so
  each leaves once prefilled), and each step runs B decodes plus one whole such prompt: the budget's
  512 tokens.

Each part is timed by wrapping what the engine calls (no change to the library): the scheduler's
``schedule``, ``prepare_batch`` (the flat batch's Python and tensors), every matrix product (the
modules' forwards, the LM head apart), the K/V write into the pool, the gather of each request's
blocks, the attention kernels (SDPA, the C kernels of the fast paged path and of a prefill chunk),
``sample_rows``; "other forward" is the rest of the forward pass (norms, RoPE, SiLU, residual adds, views,
masks, Python), "engine rest" the step's bookkeeping (append tokens, cache full blocks, the step record).
Prints a table per batch size: median ms per step of each part and its share of the step, with
the machine's load average. The allocator is set as ``minillm serve`` sets it, the KV pool in 2 MiB pages
included (minillm/malloc_policy.py; ``--glibc-defaults`` leaves glibc's: each step's large tensors then fault
their pages in again, in 4 KiB pages). Wall
times by default (the CPU runs the ops synchronously); ``--clock cpu`` takes the process's CPU time
instead, which with ``--threads 1`` a busy machine barely changes.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from minillm import load_model
from minillm.bench.arg_types import positive_int
from minillm.fast import kernels
from minillm.malloc_policy import keep_freed_memory, use_huge_pages_for_pools
from minillm.sampling import SamplingParams
from minillm.serving import engine as engine_module
from minillm.serving import model_runner
from minillm.serving.engine import LLMEngine

PARTS = ("schedule", "prepare_batch", "products", "lm_head", "cache write", "gather", "attention kernel",
         "other forward", "sampling", "engine rest")


class Timers:
    """Seconds spent in each part during the current step (nested parts are subtracted by the caller).

    ``clock``: time.perf_counter (wall) or time.process_time (CPU seconds of every thread: with one
    thread, what a busy machine's other processes barely change)."""

    def __init__(self, clock=time.perf_counter):
        self.seconds = defaultdict(float)
        self.clock = clock

    @contextmanager
    def part(self, name: str):
        start = self.clock()
        try:
            yield
        finally:
            self.seconds[name] += self.clock() - start

    def wrap(self, owner, attribute: str, name: str):
        original = getattr(owner, attribute)

        def timed(*args, **kwargs):
            with self.part(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)


def instrument(model, timers: Timers) -> None:
    """Wrap, once a process, every part the table reports but the engine's own (see the module docstring)."""
    timers.wrap(model_runner, "prepare_batch", "prepare_batch")
    timers.wrap(model_runner, "forward_batch", "forward")
    timers.wrap(engine_module, "sample_rows", "sampling")
    timers.wrap(F, "scaled_dot_product_attention", "attention kernel")
    timers.wrap(kernels, "paged_decode_attention", "attention kernel")  # the fast path's C kernel
    timers.wrap(kernels, "causal_attention", "attention kernel")  # a chunk's, in C
    timers.wrap(kernels, "causal_attention_bf16", "attention kernel")  # a bfloat16 chunk's, on pairs
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for block in model.blocks:  # stacked products live outside the module tree (minillm/fast/packing.py)
        for stack in (getattr(block.attn, "qkv", None), getattr(block.mlp, "gate_up", None)):
            if stack is not None:
                linears.append(stack.module)
    for module in linears:
        name = "lm_head" if module is model.lm_head else "products"
        module.register_forward_pre_hook(lambda m, args: timers.seconds.__setitem__("_start", timers.clock()))
        module.register_forward_hook(lambda m, args, out, name=name: timers.seconds.__setitem__(
            name, timers.seconds[name] + timers.clock() - timers.seconds["_start"]))


def instrument_engine(engine: LLMEngine, timers: Timers) -> None:
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.cache, "write", "cache write")
    timers.wrap(engine.cache, "gather", "gather")


def time_steps(engine: LLMEngine, timers: Timers, steps: int, want_prefill: bool) -> list[dict[str, float]]:
    """``steps`` engine steps, each as {part: ms}; only steps of the wanted kind (with or without a chunk)."""
    rows = []
    while len(rows) < steps:
        timers.seconds.clear()
        start = timers.clock()
        engine.step()
        total = timers.clock() - start
        record = engine.steps[-1]
        has_prefill = any(n_prefill > 1 for _, n_prefill, _ in record.scheduled)
        if has_prefill != want_prefill:
            continue
        s = dict(timers.seconds)
        s.pop("_start", None)
        forward = s.pop("forward", 0.0)
        inside = sum(s.get(p, 0.0) for p in ("products", "lm_head", "cache write", "gather", "attention kernel"))
        s["other forward"] = forward - inside
        s["engine rest"] = total - forward - sum(s.get(p, 0.0) for p in ("schedule", "prepare_batch", "sampling"))
        ms = {p: s.get(p, 0.0) * 1e3 for p in PARTS}
        ms["step"] = total * 1e3
        ms["tokens"] = sum(p + d for _, p, d in record.scheduled)
        rows.append(ms)
    return rows


def profile_batch(model, timers: Timers, batch: int, steps: int, rounds: int, seed: int, variants: dict
                  ) -> dict[tuple[str, str], list[dict[str, float]]]:
    """{(kind, variant): timed steps}: the variants (``model.paged_batch`` values) take turns on the
    same engine state, ``rounds`` times ``steps`` steps each (A B A B: a busy machine slows both)."""
    rng = random.Random(seed)
    engine = LLMEngine(model, max_num_seqs=batch + 1, kv_cache_memory="1GiB")
    instrument_engine(engine, timers)
    params = SamplingParams(temperature=0.0, max_new_tokens=4096, ignore_eos=True)
    vocab = model.config.vocab_size
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(rng.randint(32, 512))], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    result = defaultdict(list)
    for kind in ("decode", "mixed"):
        if kind == "mixed":  # prompts of (512 - batch) tokens, one output token each: every step prefills
            one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)  # one whole beside the decodes
            for _ in range(rounds * len(variants) * (steps + 1) + 2):
                engine.add_request([rng.randrange(vocab) for _ in range(512 - batch)], one)
        for _ in range(rounds):
            for name, paged_batch in variants.items():
                model.paged_batch = paged_batch
                engine.step()  # warm-up of this variant
                result[kind, name] += time_steps(engine, timers, steps, want_prefill=kind == "mixed")
    return result


def print_table(batch: int, kind: str, rows_by_variant: dict[str, list[dict[str, float]]], load) -> None:
    """One table: a row per part, for each variant its median ms per step and share of the step."""
    steps = {v: statistics.median(r["step"] for r in rows) for v, rows in rows_by_variant.items()}
    first = next(iter(rows_by_variant.values()))
    tokens = int(statistics.median(r["tokens"] for r in first))
    print(f"\nbatch {batch}, {kind}: {tokens} tokens a step; load average before {load[0]:.2f}/{load[1]:.2f}/"
          f"{load[2]:.2f}, after {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"  {'part':<18}" + "".join(f"{v + ' ms':>16}{'share':>7}" for v in rows_by_variant))
    for part in (*PARTS, "step"):
        cells = []
        for v, rows in rows_by_variant.items():
            ms = statistics.median(r[part] for r in rows)
            cells.append(f"{ms:16.2f}{ms / steps[v]:7.1%}")
        print(f"  {part:<18}" + "".join(cells))
    print("  (median of " + ", ".join(f"{len(rows)} steps" for rows in rows_by_variant.values()) + "; min step "
          + ", ".join(f"{min(r['step'] for r in rows):.1f}" for rows in rows_by_variant.values()) + " ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or the process's CPU time (robust to a busy machine with --threads 1)")
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="keep glibc's allocator settings (default: serve's, minillm/malloc_policy.py)")
    args = parser.parse_args()
    allocator = "glibc's defaults" if args.glibc_defaults else (keep_freed_memory() or "serve's (freed memory kept)")
    if not args.glibc_defaults:
        use_huge_pages_for_pools()  # the KV pool in 2 MiB pages, as minillm serve's
    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m-instruct", device="cpu", dtype=args.dtype, fast=args.fast)
    variants = {"reference": None}  # the gather + SDPA of minillm/serving/paged_attention.py
    if getattr(model, "paged_batch", None) is not None:
        variants["fast"] = model.paged_batch  # minillm/fast/paged_attention.py
    path = getattr(model, "decode_path", "plain (--no-fast)")
    threads = f"{args.threads} thread{'s' if args.threads != 1 else ''}"
    print(f"SmolLM2-135M {args.dtype}, {threads}, decode path {path}, block size 16, budget 512; "
          f"variants: {', '.join(variants)} (paged attention); {args.clock} clock; allocator {allocator}")
    timers = Timers(time.perf_counter if args.clock == "wall" else time.process_time)
    instrument(model, timers)
    for batch in args.batches:
        load_before = os.getloadavg()
        result = profile_batch(model, timers, batch, args.steps, args.rounds, args.seed, variants)
        for kind in ("decode", "mixed"):
            print_table(batch, kind, {v: result[kind, v] for v in variants}, load_before)


if __name__ == "__main__":
    main()
