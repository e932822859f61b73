"""One layer's decode attention over the paged pool: the reference's gather + masked SDPA against the C kernel.

    OMP_NUM_THREADS=1 python benchmarks/paged_decode_attention.py [--threads 1] [--reps 30]
    python benchmarks/paged_decode_attention.py --threads 2 --layers 30 --reps 10    # a whole step's
    python benchmarks/paged_decode_attention.py --threads 2 --layers 30 --dtype bfloat16

With ``--layers N`` a call runs N layers, each over its own pool (as an engine step does): the pools
(1.5 GB at 30) no longer fit in the CPU's caches, so memory, not the arithmetic, sets the pace.
``--dtype bfloat16``: q and the pools in bfloat16, as a bfloat16 server keeps them (the bytes a call reads
and the GB/s they stream at are printed beside the times). The pools are in 2 MiB pages where Linux gives them, as
a server's (``minillm.malloc_policy.use_huge_pages_for_pools``); ``--no-huge-pages`` keeps 4 KiB ones.

For batches of 8, 16 and 32 decodes with contexts uniform 100-600 (seed 0), SmolLM2-135M's attention
shape (9 query heads, 3 K/V heads, head_dim 64), block size 16, the blocks shuffled over a pool of 2,000:
the reference path of minillm/serving/paged_attention.py (``PagedKVCache.gather``, then SDPA with the mask
that hides each row's padding) and ``minillm.fast.kernels.paged_decode_attention`` (the blocks read in
place), checked equal, then called in turn ``--reps`` times each. Prints min and median ms a call of the
process's CPU time (with one thread, what other processes on a busy machine barely change), the
median wall time, and the load.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from minillm.fast import kernels
from minillm.model import sdpa_attention
from minillm.malloc_policy import use_huge_pages_for_pools
from minillm.serving.paged_cache import PagedKVCache


def random_block_tables(batch: int, block_size: int, num_blocks: int, rng: random.Random):
    """(lens [batch], tables [batch, most blocks] int64): contexts uniform 100-600 tokens, each
    sequence's blocks drawn without repeats from a shuffled pool of ``num_blocks``."""
    lens = torch.tensor([rng.randint(100, 600) for _ in range(batch)])
    n_blocks = (lens + block_size - 1) // block_size
    tables = torch.zeros(batch, int(n_blocks.max()), dtype=torch.long)
    free = torch.randperm(num_blocks).tolist()
    for b in range(batch):
        tables[b, : n_blocks[b]] = torch.tensor([free.pop() for _ in range(int(n_blocks[b]))])
    return lens, tables


def huge_page_bytes() -> int:
    """The process's anonymous memory in transparent huge pages (Linux's /proc/self/smaps_rollup; 0 elsewhere):
    what the pools got, not what was asked."""
    try:
        lines = open("/proc/self/smaps_rollup").read().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("AnonHugePages:")), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=1, help="layers a call runs, each over its own pool")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--no-huge-pages", action="store_true", help="the pools in 4 KiB pages (default: 2 MiB)")
    args = parser.parse_args()
    if not args.no_huge_pages:
        use_huge_pages_for_pools()  # as minillm serve does
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 2000, 9, 3, 64
    dtype = getattr(torch, args.dtype)
    cache = PagedKVCache(args.layers, kv_heads, head_dim, num_blocks, block_size, dtype=dtype)
    cache.k.normal_()
    cache.v.normal_()
    for batch in (8, 16, 32):
        lens, tables = random_block_tables(batch, block_size, num_blocks, rng)
        q = torch.randn(batch, heads, head_dim).to(dtype)
        kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * cache.k.element_size() * args.layers
        mask = (torch.arange(tables.shape[1] * block_size)[None] < lens[:, None])[:, None, None]

        def reference():
            for layer in range(args.layers):
                keys, values = cache.gather(layer, tables)
                out = sdpa_attention(q.unsqueeze(2), keys, values, mask).squeeze(2)
            return out

        def fast():
            for layer in range(args.layers):
                out = kernels.paged_decode_attention(q, cache.k[layer], cache.v[layer], tables, torch.zeros_like(lens),
                                                     lens, head_dim**-0.5, check=False)
            return out

        # bfloat16: a few of its steps (2^-8 relative, on outputs ~0.1) apart, both outputs rounded to it
        tolerance = {"atol": 2e-3, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-4}
        torch.testing.assert_close(fast(), reference(), **tolerance)
        times = {"gather + SDPA": [], "C kernel": []}
        walls = {name: [] for name in times}
        for _ in range(args.reps):
            for name, call in (("gather + SDPA", reference), ("C kernel", fast)):
                start, wall = time.process_time(), time.perf_counter()
                call()
                times[name].append((time.process_time() - start) * 1e3)
                walls[name].append((time.perf_counter() - wall) * 1e3)
        print(f"batch {batch}: " + "; ".join(f"{name} CPU min {min(t):.2f} median {statistics.median(t):.2f} ms, wall "
                                              f"median {statistics.median(walls[name]):.2f} ms"
                                              for name, t in times.items())
              + f"; K/V {kv_bytes / 1e6:.0f} MB, C kernel "
              + f"{kv_bytes / statistics.median(walls['C kernel']) / 1e6:.1f} GB/s"
              + f"; load average {os.getloadavg()[0]:.2f}"
              + f"; huge pages in the process {huge_page_bytes() / 2**20:,.0f} MiB (asked: "
              + f"{'no' if args.no_huge_pages else 'yes'})")


if __name__ == "__main__":
    main()
