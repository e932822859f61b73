"""Batch-1 decode and prefill speed of float32, int8 and int4 weights, in one run (issue 16).

    python benchmarks/quantized_decode.py [--model NAME] [--steps 32] [--repeats 5] [--threads N]

Loads the model three times (float32, quantize="int8", quantize="int4"), builds the C kernels
(first call, timed apart: minillm/quantize_kernels.py), then interleaves the three models repeat by repeat so that a
change of machine load hits them alike. Prints, per format: weights bytes a decode step reads,
decode ms/step and tok/s (median over steps and repeats), its ratio to float32, the share of its
own bandwidth floor (weights bytes / calibrated copy bandwidth: ``minillm calibrate``), and the
prefill ms of a 128-token prompt with its ratio to float32. Targets (issue 16): int8 >= 1.7x and
int4 >= 2.3x float32 decode; prefill not slower than 0.8x float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minillm import KVCache, decode_step, load_model, prefill
from minillm.hardware import get_hardware
from minillm.weights import DEFAULT_MODEL

FORMATS = (None, "int8", "int4")
PROMPT_TOKENS = 128


def time_prefill_ms(model, prompt: torch.Tensor) -> float:
    cache = KVCache.for_model(model, max_seq_len=prompt.shape[1] + 1)
    start = time.perf_counter()
    prefill(model, prompt, cache)
    return (time.perf_counter() - start) * 1e3


def time_decode_ms(model, prompt: torch.Tensor, steps: int) -> list[float]:
    """ms of each of ``steps`` greedy decode steps after a prefill of ``prompt``."""
    cache = KVCache.for_model(model, max_seq_len=prompt.shape[1] + steps + 1)
    token = prefill(model, prompt, cache).argmax(-1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = decode_step(model, token, cache).argmax(-1)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--steps", type=int, default=32, help="decode steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = {fmt or "float32": load_model(args.model, device="cpu", dtype="float32", quantize=fmt) for fmt in FORMATS}
    vocab = models["float32"].config.vocab_size
    prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS))
    for name, model in models.items():  # first use builds the C kernels
        start = time.perf_counter()
        time_decode_ms(model, prompt[:, :8], 2)
        print(f"{name}: first decode steps (decode path {model.decode_path}; builds the kernels) "
              f"{time.perf_counter() - start:.1f} s")
    decode = {name: [] for name in models}
    prefill_ms = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            prefill_ms[name].append(time_prefill_ms(model, prompt))
            decode[name].extend(time_decode_ms(model, prompt[:, :8], args.steps))
    bandwidth = get_hardware("cpu", torch.float32).mem_bandwidth
    base_decode, base_prefill = statistics.median(decode["float32"]), statistics.median(prefill_ms["float32"])
    print(f"\n{args.model}, batch 1, {args.threads} threads, {args.repeats} repeats x {args.steps} decode steps; "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s (calibrated)")
    print(f"{'weights':8} {'MB read':>8} {'decode ms':>10} {'tok/s':>7} {'x fp32':>7} {'% floor':>8} "
          f"{'prefill ms':>11} {'x fp32':>7}")
    for name, model in models.items():
        ms, pre = statistics.median(decode[name]), statistics.median(prefill_ms[name])
        floor_ms = model.weights_bytes() / bandwidth * 1e3
        print(f"{name:8} {model.weights_bytes() / 1e6:8.1f} {ms:10.2f} {1e3 / ms:7.1f} {base_decode / ms:7.2f} "
              f"{100 * floor_ms / ms:7.0f}% {pre:11.1f} {base_prefill / pre:7.2f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
