"""Memory a bfloat16 server's prefill chunks leave behind in SDPA's flash kernel, with and without the padding.

    python benchmarks/sdpa_shape_cache.py [--calls 1200] [--every 400] [--pad | --no-pad]

SDPA's bfloat16 flash attention on a CPU builds an AMX micro-kernel for each block shape it meets and keeps it
for the thread's life (``cpublas::brgemm``'s cache, without a limit in torch 2.13). In a fresh interpreter (one
run a mode: the cache is the process's), ``--calls`` chunks of random lengths (2-512 queries, half of them onto
1-500 cached positions; SmolLM2-135M's 9 query heads, 3 K/V heads, head_dim 64; seed 0) attend as a serving step's
chunks do: plain (``PagedBatch.attend_chunk``, the reference) or padded to multiples of 32
(``FastPagedBatch.attend_chunk``). Prints the growth of the memory in use (glibc's ``mallinfo2``: in-use heap
plus mapped blocks) every ``--every`` calls, and the seconds the calls took. Linux with glibc only.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import time

import torch

from minillm.bench.arg_types import positive_int
from minillm.fast.paged_attention import FastPagedBatch
from minillm.model import sdpa_attention
from minillm.serving.paged_attention import PagedBatch


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def in_use_mib(libc) -> float:
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=positive_int, default=1200)
    parser.add_argument("--every", type=positive_int, default=400)
    parser.add_argument("--pad", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    batch_cls = FastPagedBatch if args.pad else PagedBatch
    batch = batch_cls.__new__(batch_cls)  # (attend_chunk reads no batch state)
    attention = lambda q, k, v, mask: sdpa_attention(q, k, v, mask, 0.125, None)  # noqa: E731
    rng = random.Random(0)

    def chunk(T: int, S: int) -> None:
        q = torch.randn(1, 9, T, 64).bfloat16()
        k, v = torch.randn(1, 3, S, 64).bfloat16(), torch.randn(1, 3, S, 64).bfloat16()
        batch.attend_chunk(q, k, v, attention, None)

    for _ in range(20):
        chunk(100, 100)  # (the first call's own allocations, before the baseline)
    base, start = in_use_mib(libc), time.perf_counter()
    for i in range(1, args.calls + 1):
        T = rng.randint(2, 512)
        chunk(T, T + (0 if rng.random() < 0.5 else rng.randint(1, 500)))
        if i % args.every == 0:
            print(f"{'padded' if args.pad else 'plain'}: after {i} chunks, +{in_use_mib(libc) - base:.1f} MiB in use",
                  flush=True)
    print(f"{args.calls} chunks in {time.perf_counter() - start:.2f} s, torch {torch.__version__}")


if __name__ == "__main__":
    main()
