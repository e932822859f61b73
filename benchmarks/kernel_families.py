"""Each C kernel family (minillm/fast/csrc/) against what PyTorch ships for the same work, at the shapes
the speed layer runs it: is the C still worth its place on this machine?

    python benchmarks/kernel_families.py --threads 2 --rounds 3             # both shapes, ~6 min on 2 cores
    python benchmarks/kernel_families.py --shapes 135m --families norms     # one part

For SmolLM2-135M's and SmolLM2-360M's shapes (random weights, every layer's matrices: a decode step reads
them from memory, not from cache), per family:

    products   float32: f32_matvec (1, 8 rows) and the panels (32 rows) against F.linear and the
               speed layer's own PyTorch product (split_product: the matrix cut over the threads)
    quantized  int8/int4: quantized_matvec (1 row), quantized_matmul (8 rows), the quantised panels (32 rows)
               against torch._weight_int8pack_mm / torch._weight_int4pack_mm_for_cpu, and dequantize against
               the same dequantisation in torch ops (what prefill's product is preceded by)
    attention  decode_attention (batch 1 and 4, contexts 128 and 1024) against SDPA on the cache's view;
               paged_decode_attention (32 decodes, contexts 100-600) against the reference gather + masked
               SDPA; causal_attention (512 from empty, 128 onto 384) against SDPA
    norms      rms_norm (with the residual add) and silu_mul against the module's PyTorch ops (1, 8, 512 rows)

Candidates take turns within each round (a machine that gets busier slows them alike); a candidate's
number is the best of the rounds' medians, ms a call over all layers. Prints a markdown table with the
ratio C / best PyTorch, and the load average.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

from minillm.fast import kernels
from minillm.fast.products import split_product
from minillm.model import sdpa_attention
from minillm.quantize import QuantizedLinear, unpack_int4
from minillm.serving.paged_cache import PagedKVCache
from paged_decode_attention import random_block_tables  # the same pools as that benchmark (benchmarks/ is on sys.path)

SHAPES = {  # SmolLM2's public configs
    "135m": dict(d=576, mlp=1536, heads=9, kv_heads=3, head_dim=64, layers=30),
    "360m": dict(d=960, mlp=2560, heads=15, kv_heads=5, head_dim=64, layers=32),
    "1.7b": dict(d=2048, mlp=8192, heads=32, kv_heads=32, head_dim=64, layers=24),
}


def matrices(s: dict, layers: int | None = None) -> list[torch.Tensor]:
    """Every layer's (or the first ``layers``') q|k|v, o, gate|up and down, float32 [out, in]."""
    qkv = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    shapes = [(qkv, s["d"]), (s["d"], s["heads"] * s["head_dim"]), (2 * s["mlp"], s["d"]), (s["d"], s["mlp"])]
    return [torch.randn(o, i) / i ** 0.5 for _ in range(layers or s["layers"]) for o, i in shapes]


def race(candidates: dict, rounds: int, reps: int, clock=time.perf_counter) -> dict[str, float]:
    """ms a call of each candidate: the best of the rounds' medians, the candidates taking turns. ``clock``:
    wall time, or (one thread on a busy machine) ``time.thread_time``, the CPU time this thread got."""
    best = {name: float("inf") for name in candidates}
    for name, fn in candidates.items():
        fn()  # untimed: first-call costs (packing, allocation)
    for _ in range(rounds):
        for name, fn in candidates.items():
            times = []
            for _ in range(reps):
                start = clock()
                fn()
                times.append(clock() - start)
            best[name] = min(best[name], statistics.median(times) * 1e3)
    return best


def products(s, rounds, reps):
    ws = matrices(s)
    panels = [kernels.f32_pack_panels(w) for w in ws]
    for rows in (1, 8, 32):
        x = [torch.randn(rows, w.shape[1]) for w in ws]
        c = (lambda: [kernels.f32_matvec(a, w) for a, w in zip(x, ws)]) if rows <= 8 else \
            (lambda: [kernels.f32_panel_matmul(a, p) for a, p in zip(x, panels)])
        yield f"float32 product, {rows} rows", "f32_matvec" if rows <= 8 else "f32_panel_matmul", race({
            "C": c,
            "F.linear": lambda: [F.linear(a, w) for a, w in zip(x, ws)],
            "split_product": lambda: [split_product(a, w) for a, w in zip(x, ws)]}, rounds, reps)


def quantized(s, rounds, reps):
    ws = matrices(s)
    for fmt in ("int8", "int4"):
        layers = [QuantizedLinear(w, None, fmt) for w in ws]
        panels = [kernels.quantized_pack_panels(m.qweight, m.scale, m.zero if fmt == "int4" else None,
                                                m.group_size if fmt == "int4" else None) for m in layers]
        args = [(m.qweight, m.scale, m.zero, m.group_size) for m in layers]  # (zero None: int8)
        if fmt == "int8":
            torch_mm = [lambda a, m=m: torch._weight_int8pack_mm(a, m.qweight, m.scale) for m in layers]
            torch_dq = [lambda m=m: m.qweight.float() * m.scale[:, None] for m in layers]
        else:
            torch_mm, torch_dq = [], []
            for m in layers:  # int4pack's ŵ = (q - 8)·scale + zero', so zero' = (8 - zero)·scale: the same ŵ
                packed = torch._convert_weight_to_int4pack_for_cpu(unpack_int4(m.qweight, m.in_features).int(), 2)
                sz = torch.stack([m.scale, (8 - m.zero.float()) * m.scale], -1).transpose(0, 1).contiguous()
                torch_mm.append(lambda a, p=packed, sz=sz, g=m.group_size: torch._weight_int4pack_mm_for_cpu(a, p, g, sz))
                torch_dq.append(lambda m=m: ((unpack_int4(m.qweight, m.in_features).float().unflatten(1, (-1, m.group_size))
                                              - m.zero[..., None]) * m.scale[..., None]).flatten(1))
        for rows, kernel in ((1, "matvec"), (8, "matmul"), (32, "panels")):
            x = [torch.randn(rows, m.in_features) for m in layers]
            if kernel == "panels":
                c = lambda: [kernels.quantized_panel_matmul(a, p) for a, p in zip(x, panels)]
            else:
                f = getattr(kernels, f"quantized_{kernel}")
                c = lambda f=f: [f(a, *arg) for a, arg in zip(x, args)]
            name = "quantized_panel_matmul" if kernel == "panels" else f"quantized_{kernel}"
            yield f"{fmt} product, {rows} rows", name, race({
                "C": c, f"torch {fmt}pack_mm": lambda: [mm(a) for mm, a in zip(torch_mm, x)]}, rounds, reps)
        yield f"{fmt} dequantise (prefill)", "dequantize", race({
            "C": lambda: [kernels.dequantize(*arg) for arg in args], "torch ops": lambda: [f() for f in torch_dq]},
            rounds, reps)


def attention(s, rounds, reps):
    L, H, Hkv, D = s["layers"], s["heads"], s["kv_heads"], s["head_dim"]
    scale = D ** -0.5
    for batch in (1, 4):
        for context in (128, 1024):
            ks = [torch.randn(batch, Hkv, context + 64, D) for _ in range(L)]  # a static buffer, partly filled
            vs = [torch.randn_like(k) for k in ks]
            q = torch.randn(batch, H, 1, D)
            yield f"decode attention, batch {batch}, context {context}", "decode_attention", race({
                "C": lambda: [kernels.decode_attention(q, k, v, context, scale) for k, v in zip(ks, vs)],
                "SDPA": lambda: [sdpa_attention(q, k[:, :, :context], v[:, :, :context], scale=scale)
                                 for k, v in zip(ks, vs)]}, rounds, reps)
    yield from paged(s, rounds, reps)
    for T, S in ((512, 512), (128, 512)):
        ks = [torch.randn(1, Hkv, S, D) for _ in range(4)]  # prefill is compute-bound: 4 layers suffice
        vs = [torch.randn_like(k) for k in ks]
        q = torch.randn(1, H, T, D)
        yield f"causal attention, {T} queries onto {S - T} cached (4 layers)", "causal_attention", race({
            "C": lambda: [kernels.causal_attention(q, k, v, scale) for k, v in zip(ks, vs)],
            "SDPA": lambda: [sdpa_attention(q, k, v, scale=scale) for k, v in zip(ks, vs)]}, rounds, reps)


def paged(s, rounds, reps, batch=32, block_size=16, num_blocks=1200):
    L, H, Hkv, D = s["layers"], s["heads"], s["kv_heads"], s["head_dim"]
    rng = random.Random(0)
    cache = PagedKVCache(L, Hkv, D, num_blocks, block_size)
    cache.k.normal_()
    cache.v.normal_()
    lens, tables = random_block_tables(batch, block_size, num_blocks, rng)
    q, first = torch.randn(batch, H, D), torch.zeros(batch, dtype=torch.long)
    mask = (torch.arange(tables.shape[1] * block_size)[None] < lens[:, None])[:, None, None]

    def reference():
        for layer in range(L):
            keys, values = cache.gather(layer, tables)
            sdpa_attention(q.unsqueeze(2), keys, values, mask, scale=D ** -0.5)

    yield f"paged decode attention, {batch} decodes of 100-600", "paged_decode_attention", race({
        "C": lambda: [kernels.paged_decode_attention(q, cache.k[i], cache.v[i], tables, first, lens, D ** -0.5,
                                                     check=False) for i in range(L)],
        "gather + SDPA": reference}, rounds, reps)


def norms(s, rounds, reps):
    d, F2 = s["d"], 2 * s["mlp"]
    w = torch.rand(d)

    def torch_rms(x, delta):  # minillm.model.RMSNorm's ops, after the residual add
        x = x + delta
        return x, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    for rows in (1, 8, 512):
        xs = [(torch.randn(rows, d), torch.randn(rows, d)) for _ in range(2 * s["layers"])]
        yield f"residual add + RMSNorm, {rows} rows", "rms_norm", race({
            "C": lambda: [kernels.rms_norm(x, w, 1e-5, delta) for x, delta in xs],
            "torch ops": lambda: [torch_rms(x, delta) for x, delta in xs]}, rounds, reps)
        gate_up = [torch.randn(rows, F2) for _ in range(s["layers"])]
        yield f"silu(gate) * up, {rows} rows", "silu_mul", race({
            "C": lambda: [kernels.silu_mul(g) for g in gate_up],
            "torch ops": lambda: [(lambda a, b: F.silu(a) * b)(*g.chunk(2, -1)) for g in gate_up]}, rounds, reps)


FAMILIES = {"products": products, "quantized": quantized, "attention": attention, "norms": norms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["135m", "360m"], choices=list(SHAPES))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    assert kernels.available(), kernels.unavailable_reason()
    print(f"threads {args.threads}, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}\n")
    print("| shape | work | C kernel | C ms | PyTorch ms | C / best PyTorch |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes:
        for family in args.families:
            for work, kernel, ms in FAMILIES[family](SHAPES[shape], args.rounds, args.reps):
                others = {k: v for k, v in ms.items() if k != "C"}
                best = min(others.values())
                torch_ms = ", ".join(f"{k} {v:.3g}" for k, v in others.items())
                print(f"| {shape} | {work} | {kernel} | {ms['C']:.3g} | {torch_ms} | {ms['C'] / best:.2f} |", flush=True)
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
