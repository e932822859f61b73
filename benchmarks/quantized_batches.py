"""Quantised weights at a serving step's batch sizes, against float32: each product, and whole engine steps.

    python benchmarks/quantized_batches.py [--rows 1 8 9 16 24 32] [--batches 16 32] [--repeats 15]
                                           [--engine-rounds 3] [--threads N] [--model NAME] [--no-engine]
                                           [--clock wall|cpu] [--kernel-rows 3 4 128 256]

Loads the model three times (float32, quantize="int8", quantize="int4"), each with the speed layer and
the decode path load_model chooses, and times what a serving step runs:

1. **Products.** Layer 0's modules of each model, as the model runs them: q|k|v stacked, o, k alone
   (576 -> 192), gate|up stacked, down, and the LM head, on x [rows, in] (random), the three formats
   taking turns call by call (A B C, A B C, ...) so that a change of machine load hits them alike.
   Per rows and matrix: each format's min and median ms, and int8/float32 and int4/float32, the ratio
   of the medians (below 1: the quantised product is faster) and of the mins. "best float" is the
   fastest of the model's float32 module, ``F.linear`` (MKL) and ``split_product``: the ratios are
   also given against it, so a faster float32 product cannot hide behind the one the model picked.
2. **The quantised kernels by rows** (with --kernel-rows): for each quantised matrix, the three
   products FastQuantizedLinear chooses between by the number of rows (minillm/fast/products.py):
   the fused kernel (``int8_matvec``), the tiled one (``int8_matmul``) and the unpacked float matrix
   with ``F.linear``, interleaved; the medians, and the fastest. Where its thresholds come from.
3. **Engine steps** (unless --no-engine). Per batch size B: an ``LLMEngine`` per format with
   max_num_seqs=B, B requests of --prompt-len tokens and --new-tokens new tokens each added at once;
   the median ms of the steps that are only decodes of B rows (the forward pass, sampling and
   bookkeeping). Formats interleaved round by round; the median over all rounds' steps.

``--clock cpu`` (with ``--threads 1``) times CPU seconds instead of wall seconds: the calling
thread's for a product, the process's for a step. On a machine other processes keep busy (load
average above the core count) a wall-clock time is mostly the waits for a core; the CPU time of one
thread is the work itself. (With more threads, CPU time would count OpenMP's spinning workers.)

Each row prints the machine's load average (1 min). Needs the C kernels (a C compiler) for the
quantised fast path; without them the quantised models run their reference product.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from minillm import LLMEngine, SamplingParams, load_model
from minillm.bench.arg_types import positive_int
from minillm.fast import kernels
from minillm.fast.products import split_product
from minillm.formats.weights import DEFAULT_MODEL

FORMATS = ("float32", "int8", "int4")


def layer0_products(model) -> dict[str, torch.nn.Module]:
    """The modules a decode step multiplies by, by name: stacked where the speed layer stacks them."""
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    products = {"q|k|v": attn.qkv.module if attn.qkv is not None else None, "o": attn.o_proj, "k": attn.k_proj,
                "gate|up": getattr(mlp, "gate_up", None) and mlp.gate_up.module, "down": mlp.down_proj,
                "lm_head": model.lm_head}
    return {name: m for name, m in products.items() if m is not None}


# (a product's clock, an engine step's clock)
CLOCKS = {"wall": (time.perf_counter, time.perf_counter), "cpu": (time.thread_time, time.process_time)}


def timed_ms(fn, x, clock) -> float:
    start = clock()
    fn(x)
    return (clock() - start) * 1e3


def time_products(models: dict, rows_list: list[int], repeats: int, clock) -> None:
    products = {fmt: layer0_products(m) for fmt, m in models.items()}
    print(f"{'matrix':>8} {'out x in':>12} {'rows':>4} | " + " | ".join(f"{f:>7} min/med ms" for f in FORMATS)
          + f" | {'best float':>10} | {'int8/f32':>8} {'int4/f32':>8} (medians; mins) | vs best float | load")
    for name, float_module in products["float32"].items():
        weight = float_module.weight
        out, n_in = weight.shape
        for rows in rows_list:
            x = torch.randn(rows, n_in)
            fns = {fmt: products[fmt][name] for fmt in FORMATS}
            fns["mkl"], fns["split"] = (lambda x: F.linear(x, weight)), (lambda x: split_product(x, weight))
            for fn in fns.values():
                fn(x)  # (first calls: builds, allocations)
            times = {k: [] for k in fns}
            for _ in range(repeats if out < 10_000 else max(3, repeats // 3)):
                for k, fn in fns.items():
                    times[k].append(timed_ms(fn, x, clock))
            low = {k: min(v) for k, v in times.items()}
            med = {k: statistics.median(v) for k, v in times.items()}
            best = min(("float32", "mkl", "split"), key=lambda k: med[k])
            print(f"{name:>8} {f'{out}x{n_in}':>12} {rows:4} | "
                  + " | ".join(f"{low[f]:7.3f}/{med[f]:7.3f}  " for f in FORMATS)
                  + f" | {best:>6} {med[best]:7.3f}"
                  + f" | {med['int8'] / med['float32']:8.2f} {med['int4'] / med['float32']:8.2f}"
                  + f" ({low['int8'] / low['float32']:.2f}; {low['int4'] / low['float32']:.2f})"
                  + f" | {med['int8'] / med[best]:5.2f} {med['int4'] / med[best]:5.2f} | {os.getloadavg()[0]:.2f}",
                  flush=True)


def time_kernels(models: dict, rows_list: list[int], repeats: int, clock) -> None:
    print(f"\nthe quantised kernels by rows, median ms\n{'matrix':>8} {'format':>6} {'rows':>4} | {'fused':>8} "
          f"{'tiled':>8} {'unpacked':>8} | fastest | load")
    for fmt in ("int8", "int4"):
        for name, m in layer0_products(models[fmt]).items():
            codes = (m.qweight, m.scale) if fmt == "int8" else (m.qweight, m.scale, m.zero, m.group_size)
            fns = {"fused": lambda x: getattr(kernels, f"{fmt}_matvec")(x, *codes),
                   "tiled": lambda x: getattr(kernels, f"{fmt}_matmul")(x, *codes),
                   "unpacked": lambda x: F.linear(x, m._unpacked())}
            for rows in rows_list:
                x = torch.randn(rows, m.in_features)
                times = {k: [] for k in fns}
                for _ in range(repeats if m.out_features < 10_000 else max(3, repeats // 3)):
                    for k, fn in fns.items():
                        times[k].append(timed_ms(fn, x, clock))
                med = {k: statistics.median(v) for k, v in times.items()}
                print(f"{name:>8} {fmt:>6} {rows:4} | " + " ".join(f"{med[k]:8.3f}" for k in fns)
                      + f" | {min(med, key=med.get):>8} | {os.getloadavg()[0]:.2f}", flush=True)


def decode_steps_ms(model, batch: int, prompt_len: int, new_tokens: int, seed: int, step_clock) -> list[float]:
    """Run ``batch`` requests at once; the ms of each step that decoded all ``batch`` of them."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    engine = LLMEngine(model, max_num_seqs=batch, max_num_batched_tokens=max(batch * prompt_len, 256))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params)
    times = []
    while engine.has_unfinished_requests():
        start = step_clock()
        engine.step()
        ms, last = (step_clock() - start) * 1e3, engine.steps[-1]
        if last.num_prefill_tokens == 0 and last.num_decode_tokens == batch:
            times.append(ms)
    return times


def time_engine(models: dict, batches: list[int], rounds: int, prompt_len: int, new_tokens: int, step_clock) -> None:
    print(f"\nengine decode steps: {prompt_len}-token prompts, {new_tokens} new tokens each, all added at once")
    print(f"{'batch':>5} | " + " | ".join(f"{f:>7} ms/step" for f in FORMATS)
          + f" | {'int8/f32':>8} {'int4/f32':>8} | {'int8 tok/s':>10} {'fp32 tok/s':>10} | steps | load")
    for batch in batches:
        steps = {fmt: [] for fmt in FORMATS}
        for r in range(rounds):
            for fmt, model in models.items():
                steps[fmt] += decode_steps_ms(model, batch, prompt_len, new_tokens, r, step_clock)
        med = {fmt: statistics.median(v) for fmt, v in steps.items()}
        print(f"{batch:5} | " + " | ".join(f"{med[f]:15.2f}" for f in FORMATS)
              + f" | {med['int8'] / med['float32']:8.2f} {med['int4'] / med['float32']:8.2f}"
              + f" | {batch / med['int8'] * 1e3:10.1f} {batch / med['float32'] * 1e3:10.1f}"
              + f" | {min(len(v) for v in steps.values()):5} | {os.getloadavg()[0]:.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 9, 16, 24, 32])
    p.add_argument("--batches", type=positive_int, nargs="+", default=[16, 32])
    p.add_argument("--repeats", type=positive_int, default=15,
                   help="calls per format and shape (a third for the LM head)")
    p.add_argument("--engine-rounds", type=positive_int, default=3)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--new-tokens", type=positive_int, default=16)
    p.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    p.add_argument("--no-engine", action="store_true", help="time the products only")
    p.add_argument("--kernel-rows", type=positive_int, nargs="*", default=[],
                   help="also time the three quantised kernels against each other at these rows (e.g. 3 4 128 256)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall seconds, or CPU seconds (use with --threads 1 on a busy machine)")
    args = p.parse_args()
    clock, step_clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {fmt: load_model(args.model, device="cpu", dtype="float32", quantize=None if fmt == "float32" else fmt)
              for fmt in FORMATS}
    threads = f"{args.threads} thread{'s' if args.threads != 1 else ''}"
    print(f"{args.model}, {threads}, {args.clock} clock, decode path {models['float32'].decode_path}, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    time_products(models, args.rows, args.repeats, clock)
    if args.kernel_rows:
        time_kernels(models, args.kernel_rows, args.repeats, clock)
    if not args.no_engine:
        time_engine(models, args.batches, args.engine_rounds, args.prompt_len, args.new_tokens, step_clock)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
