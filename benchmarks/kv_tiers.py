"""KV blocks beyond the pool, measured: bytes per block, the disk tier's MB/s, load or recompute, TTFT.

    python benchmarks/kv_tiers.py                       # SmolLM2-135M float32, block 16, ~1 min on 2 cores
    python benchmarks/kv_tiers.py --prompt-tokens 1000 --blocks 64

Prints, for the default model (float32 on the CPU, block_size 16):

1. bytes per block (2 · n_layers · block_size · n_kv_heads · head_dim · 4 bytes);
2. the disk tier's write and read MB/s over ``--blocks`` blocks in a temp folder (a write: copy,
   sha256, temp file, rename; a read: file, sha256 check, tensors): reads from the page cache, and
   "cold" reads after each file is fsync'ed and dropped from the page cache (posix_fadvise DONTNEED;
   on a VM the host may still cache it);
3. load or recompute for a ``--prompt-tokens`` prefix (whatif.load_or_recompute) with this machine's
   calibration (``minillm calibrate``; an estimate without one) and the bandwidths just measured;
4. the TTFT of one repeated prompt of ``--prompt-tokens`` random token ids, one run each: cold (no
   tiers), a pool hit (after one unreported hit: the first pass of a process over a context this long
   pays one-time costs, 5 s more here), cold with a disk tier
   (the write-through included), a host hit (the pool's
   blocks pushed to the host tier first, by allocating every pool block for a dummy request, which
   costs no compute), and a disk hit in a new engine on the same folder (page cache warm, then cold).

The machine's 1-minute load average is printed before and after: timings on a busy machine are slower.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

import minillm
from minillm import LLMEngine, SamplingParams
from minillm.serving.kv_tiers import DiskTier
from minillm.serving.kv_tiers.offload import default_hardware
from minillm.whatif import load_or_recompute


def loadavg() -> str:
    return open("/proc/loadavg").read().split()[0]


def disk_bandwidth(model, block_size: int, n_blocks: int, folder: Path) -> tuple[float, float, float, float]:
    """(write MB/s, warm read MB/s, cold read MB/s, ms per block written) over n_blocks random blocks."""
    tier = DiskTier.for_model(folder, model, block_size)
    blocks = [(bytes([i % 256, i // 256]) * 16, torch.randn(tier.shape), torch.randn(tier.shape))
              for i in range(n_blocks)]
    n_bytes = n_blocks * tier.payload_bytes
    start = time.perf_counter()
    for h, k, v in blocks:
        tier.put(h, k, v)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    assert all(tier.get(h) is not None for h, _, _ in blocks)
    warm_s = time.perf_counter() - start
    drop_from_page_cache(tier.path)
    start = time.perf_counter()
    assert all(tier.get(h) is not None for h, _, _ in blocks)
    cold_s = time.perf_counter() - start
    return n_bytes / write_s / 1e6, n_bytes / warm_s / 1e6, n_bytes / cold_s / 1e6, write_s / n_blocks * 1e3


def drop_from_page_cache(folder: Path) -> None:
    for path in folder.glob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ttft_ms(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """(TTFT in ms, cached tokens) of one request run alone."""
    out = engine.generate([prompt], SamplingParams(max_new_tokens=1))[0]
    request = engine.requests[out.request_id]
    return (request.token_times_s[0] - request.arrival_s) * 1e3, out.num_cached_tokens


def push_pool_to_host(engine: LLMEngine) -> None:
    """Every cached pool block evicted (through the eviction hook, to the host tier) with no compute:
    a dummy request takes every block of the pool, then lets go."""
    pool = engine.cache.allocator
    assert pool.allocate_slots("pool pressure", pool.num_blocks * pool.block_size)
    pool.free("pool pressure")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=128, help="blocks for the disk MB/s (default 128)")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    args = parser.parse_args()
    print(f"load average before: {loadavg()} ({os.cpu_count()} cores), torch threads {torch.get_num_threads()}")
    model = minillm.load_model(args.model, device="cpu")
    B = args.block_size
    with tempfile.TemporaryDirectory() as tmp:
        probe = LLMEngine(model, num_blocks=1, block_size=B)
        per_block = probe.cache.bytes_per_block
        print(f"1. bytes per block ({args.model}, float32, block_size {B}): {per_block:,} "
              f"({per_block / 2**10:.0f} KiB; {per_block // B:,} bytes a token)")
        write_mb_s, warm_mb_s, cold_mb_s, write_ms = disk_bandwidth(model, B, args.blocks, Path(tmp) / "bw")
        print(f"2. disk tier over {args.blocks} blocks ({args.blocks * per_block / 1e6:.0f} MB): write {write_mb_s:,.0f} "
              f"MB/s ({write_ms:.2f} ms a block), read {warm_mb_s:,.0f} MB/s (page cache), {cold_mb_s:,.0f} MB/s "
              "(dropped from the page cache)")
        hw = default_hardware(torch.device("cpu"), torch.float32)
        print(f"3. load or recompute, a {args.prompt_tokens}-token prefix, on {hw}:")
        for tier, bytes_per_s in (("host", hw.mem_bandwidth / 2), ("disk (page cache)", warm_mb_s * 1e6),
                                  ("disk (cold)", cold_mb_s * 1e6)):
            a = load_or_recompute(model.config, hw, bytes_per_s, args.prompt_tokens, 0, 4)
            print(f"   {tier:17s} {bytes_per_s / 1e9:6.2f} GB/s: load {a.load_ms:8.1f} ms, recompute "
                  f"(roofline floor) {a.recompute_ms:8.1f} ms -> {a.choice}")

        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (args.prompt_tokens,), generator=g).tolist()
        needed = -(-(args.prompt_tokens + 1) // B)
        plain = LLMEngine(model, num_blocks=needed + 2, block_size=B)
        rows = [("cold, no tiers", *ttft_ms(plain, prompt))]
        ttft_ms(plain, prompt)  # warm-up: the first pass over a 2,000-token context pays one-time costs (buffers)
        rows.append(("pool hit", *ttft_ms(plain, prompt)))
        folder = Path(tmp) / "tiers"
        engine = LLMEngine(model, num_blocks=needed + 2, block_size=B, kv_offload_memory="1GiB",
                           kv_offload_dir=folder)
        rows.append(("cold, disk tier (write-through)", *ttft_ms(engine, prompt)))
        push_pool_to_host(engine)
        rows.append(("host hit", *ttft_ms(engine, prompt)))
        engine.close()
        rows.append(("disk hit, new engine (page cache)", *ttft_ms(
            LLMEngine(model, num_blocks=needed + 2, block_size=B, kv_offload_dir=folder), prompt)))
        drop_from_page_cache(next(folder.iterdir()))
        restarted = LLMEngine(model, num_blocks=needed + 2, block_size=B, kv_offload_dir=folder)
        rows.append(("disk hit, new engine (cold)", *ttft_ms(restarted, prompt)))
        print(f"4. TTFT of a repeated {args.prompt_tokens}-token prompt (one run each):")
        for name, ms, cached in rows:
            print(f"   {name:34s} {ms:9.1f} ms   cached_tokens {cached}")
        decisions = [d for s in restarted.steps for d in s.tier_decisions]
        for d in decisions:
            print(f"   its decision: {d.tier} {d.num_blocks} blocks {d.num_bytes / 1e6:.1f} MB: load {d.load_ms:.1f} ms "
                  f"vs recompute {d.recompute_ms:.1f} ms -> {d.choice}")
    print(f"load average after: {loadavg()}")


if __name__ == "__main__":
    main()
