"""Batch-1 decode and prefill speed of float, int8 and int4 weights, in one run (issue 16).

    python benchmarks/quantized_decode.py [--model NAME] [--steps 32] [--repeats 5] [--threads N]
                                          [--device cpu|cuda] [--dtype D] [--compile]

Loads the model three times (float, quantize="int8", quantize="int4"; float32 on a CPU, bfloat16
on a GPU unless --dtype says otherwise), runs a first decode (it builds the CPU kernels, or
compiles with --compile: timed apart), then interleaves the three models repeat by repeat so that
a change of machine load hits them alike. Prints, per format: weights bytes a decode step reads,
decode ms/step and tok/s (median over steps and repeats), its ratio to the float model, the share
of its own bandwidth floor (weights bytes / calibrated bandwidth: ``minillm calibrate``), and the
prefill ms of a 128-token prompt with its ratio. ``--compile`` decodes with
``compile_decode_step`` (CUDA graphs on a GPU: "reduce-overhead"; on a CPU the kernels run as
torch ops inside the graph). Targets (issue 16, CPU): int8 >= 1.7x and int4 >= 2.3x float32
decode; prefill not slower than 0.8x float32. ``benchmarks/gpu_check.sh`` runs the GPU row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minillm import KVCache, decode_step, load_model, prefill
from minillm.fast.compile import compile_decode_step
from minillm.hardware import get_hardware
from minillm.formats.weights import DEFAULT_MODEL

FORMATS = (None, "int8", "int4")
PROMPT_TOKENS = 128


def now(device: str) -> float:
    """perf_counter after the device's queued work is done (a GPU runs asynchronously)."""
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def time_prefill_ms(model, prompt: torch.Tensor) -> float:
    device = prompt.device.type
    cache = KVCache.for_model(model, max_seq_len=prompt.shape[1] + 1)
    start = now(device)
    prefill(model, prompt, cache)
    return (now(device) - start) * 1e3


def time_decode_ms(model, prompt: torch.Tensor, steps: int, step=decode_step) -> list[float]:
    """ms of each of ``steps`` greedy decode steps after a prefill of ``prompt``."""
    device = prompt.device.type
    cache = KVCache.for_model(model, max_seq_len=prompt.shape[1] + steps + 1)
    token = prefill(model, prompt, cache).argmax(-1)
    times = []
    for _ in range(steps):
        start = now(device)
        token = step(model, token, cache).argmax(-1)
        times.append((now(device) - start) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--steps", type=int, default=32, help="decode steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default=None, help="the float model's dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--compile", action="store_true", help="decode with compile_decode_step (CUDA graphs on a GPU)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    step = compile_decode_step("reduce-overhead" if args.device == "cuda" else "default") if args.compile else decode_step
    models = {fmt or dtype: load_model(args.model, device=args.device, dtype=dtype, quantize=fmt) for fmt in FORMATS}
    vocab = models[dtype].config.vocab_size
    prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS), device=args.device)
    for name, model in models.items():
        start = time.perf_counter()
        time_decode_ms(model, prompt[:, :8], 2, step)
        print(f"{name}: first decode steps (decode path {model.decode_path}; builds the kernels"
              f"{', compiles' if args.compile else ''}) {time.perf_counter() - start:.1f} s")
    decode = {name: [] for name in models}
    prefill_ms = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            prefill_ms[name].append(time_prefill_ms(model, prompt))
            decode[name].extend(time_decode_ms(model, prompt[:, :8], args.steps, step))
    bandwidth = get_hardware(args.device, getattr(torch, dtype)).mem_bandwidth
    base_decode, base_prefill = statistics.median(decode[dtype]), statistics.median(prefill_ms[dtype])
    print(f"\n{args.model} on {args.device}{' (compiled decode)' if args.compile else ''}, batch 1, "
          f"{args.threads} threads, {args.repeats} repeats x {args.steps} decode steps; "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'weights':8} {'MB read':>8} {'decode ms':>10} {'tok/s':>7} {'x float':>7} {'% floor':>8} "
          f"{'prefill ms':>11} {'x float':>7}")
    for name, model in models.items():
        ms, pre = statistics.median(decode[name]), statistics.median(prefill_ms[name])
        floor_ms = model.weights_bytes() / bandwidth * 1e3
        print(f"{name:8} {model.weights_bytes() / 1e6:8.1f} {ms:10.2f} {1e3 / ms:7.1f} {base_decode / ms:7.2f} "
              f"{100 * floor_ms / ms:7.0f}% {pre:11.1f} {base_prefill / pre:7.2f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
