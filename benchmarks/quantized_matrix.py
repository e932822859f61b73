"""One quantised matrix, slowly: SmolLM2's LM head (49152 x 576) in float32, int8 and int4.

    python benchmarks/quantized_matrix.py [--model NAME] [--threads N] [--repeats 20]

For each format: bytes (codes + scales + zeros), the weight error (max |w - ŵ| in units of the
row's or group's scale: <= 0.5 by construction; mean |w - ŵ| relative to mean |w|), the error of
one decode product x @ Wᵀ (x: the last hidden state of a real prompt) relative to float32's,
whether the top-1 token is unchanged, and the time of one product by the reference path
(dequantise then F.linear), the speed layer's product (FastQuantizedLinear: the C kernel of minillm/fast/csrc/quantized.c; its first
call, which builds the kernels, is timed apart) and float32 ``F.linear`` on the same, column-major, layout the model uses.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from minillm import KVCache, load_model, load_tokenizer, prefill
from minillm.fast.products import FastQuantizedLinear
from minillm.formats.weights import DEFAULT_MODEL


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def last_hidden_state(model, tokenizer) -> torch.Tensor:
    """x [1, d_model]: what the LM head multiplies after a real prompt (the final norm's output)."""
    seen = {}
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    prefill(model, ids, KVCache.for_model(model, max_seq_len=16),
            hook=lambda name, t: seen.__setitem__(name, t) if name == "ln_final.hook_normalized" else None)
    return seen["ln_final.hook_normalized"][0, -1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu", dtype="float32")
    x = last_hidden_state(model, load_tokenizer(args.model))
    w = model.lm_head.weight  # [vocab, d_model], column-major on the long-rows paths (minillm/fast/packing.py)
    y = F.linear(x, w)
    print(f"{args.model} LM head {tuple(w.shape)}; x: the final hidden state of 'The capital of France is'; "
          f"{args.threads} threads")
    print(f"{'format':8} {'MB':>6} {'max err/scale':>14} {'mean err':>9} {'product err':>12} {'top-1':>6} "
          f"{'reference ms':>13} {'fast ms':>8} {'first call s':>13}")
    print(f"{'float32':8} {w.numel() * 4 / 1e6:6.1f} {'-':>14} {'-':>9} {'-':>12} {'same':>6} "
          f"{median_ms(lambda: F.linear(x, w), args.repeats):13.2f} {'-':>8} {'-':>13}")
    for fmt in ("int8", "int4"):
        layer = FastQuantizedLinear(w, None, fmt)
        w_hat = layer.dequantize()
        step = layer.scale[:, None] if fmt == "int8" else layer.scale.repeat_interleave(layer.group_size, 1)
        start = time.perf_counter()
        y_q = layer(x)
        first_s = time.perf_counter() - start
        product_err = ((y_q - y).abs().max() / y.abs().max()).item()
        same = "same" if y_q.argmax() == y.argmax() else "DIFF"
        print(f"{fmt:8} {layer.weights_bytes() / 1e6:6.1f} {((w - w_hat).abs() / step).max().item():14.3f} "
              f"{((w - w_hat).abs().mean() / w.abs().mean()).item():9.4f} {product_err:12.5f} {same:>6} "
              f"{median_ms(lambda: layer.forward_reference(x), max(3, args.repeats // 4)):13.2f} "
              f"{median_ms(lambda: layer(x), args.repeats):8.2f} {first_s:13.1f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
