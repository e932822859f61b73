"""The engine's disk tier within a size bound (``kv_offload_disk_size``), on a tiny model, block_size 4.

Oracle: the order in which the workload writes its full blocks, from the block hashes of each
request's prompt and output (``block_hashes``, the chain the engine names blocks by), and the LRU
rule by hand: a bound of N block files keeps the N written last, except that a pinned cache
point's blocks are kept first. A step writes the blocks it completed tail first (a chain should lose
its tail before its head): a request's 9 prompt blocks in its prefill step, last to first, then its
10th block in a decode step. The tier's clock is injected and ticks at every reading, so two
files never share an mtime (the LRU order is the write order, not a tie broken by name).
"""

import shutil

import pytest
import torch

from minillm import LLMEngine, SamplingParams
from minillm.block_hash import block_hashes
from minillm.hardware import HardwareProfile
from minillm.serving.kv_tiers import CachePoint

B, PROMPT, N_PROMPTS, MAX_NEW = 4, 37, 5, 5
GREEDY = SamplingParams(max_new_tokens=MAX_NEW)
FULL_BLOCKS = (PROMPT + MAX_NEW - 1) // B  # 10: every token but the last sampled one goes through the model
PREFILL_BLOCKS = PROMPT // B  # 9, written by the prefill step


class TickingClock:
    def __init__(self):
        self.now = 1e9

    def __call__(self):
        self.now += 1.0
        return self.now


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (PROMPT,), generator=g).tolist() for _ in range(N_PROMPTS)]


def run(engine, prompts, cache_points=None):
    """Each prompt alone, to the end; returns (the full-block hashes in the order written, the most
    bytes the disk tier held after any step)."""
    written, most_bytes = [], 0
    for i, prompt in enumerate(prompts):
        rid = engine.add_request(prompt, GREEDY, cache_point=(cache_points or {}).get(i))
        while engine.has_unfinished_requests():
            engine.step()
            most_bytes = max(most_bytes, engine.offload.disk.bytes_used)
        request = engine.requests[rid]
        chain = block_hashes((request.prompt_ids + request.output_ids)[: FULL_BLOCKS * B], B,
                             engine.cache.allocator.seed)
        written += chain[:PREFILL_BLOCKS][::-1] + chain[PREFILL_BLOCKS:]
    return written, most_bytes


def make_engine(tiny_model, folder, n_files: int):
    probe = LLMEngine(tiny_model("llama_gqa"), num_blocks=12, block_size=B, kv_offload_dir=folder)
    file_bytes = probe.offload.disk.file_bytes
    engine = LLMEngine(tiny_model("llama_gqa"), num_blocks=12, block_size=B, eos_token_ids=(), max_num_seqs=1,
                       kv_offload_dir=folder, kv_offload_disk_size=n_files * file_bytes + file_bytes // 2)
    clock = TickingClock()
    engine.offload.clock = engine.offload.disk.clock = clock
    return engine, file_bytes


def on_disk(engine) -> set[bytes]:
    return {bytes.fromhex(p.stem) for p in engine.offload.disk.path.glob("*.kv")}


def test_a_bounded_disk_tier_keeps_the_blocks_written_last_and_never_exceeds_its_bound(tiny_model, prompts,
                                                                                      tmp_path):
    engine, file_bytes = make_engine(tiny_model, tmp_path, n_files=25)
    assert engine.offload.disk.capacity_bytes == 25 * file_bytes + file_bytes // 2
    written, most_bytes = run(engine, prompts)
    assert len(written) == N_PROMPTS * FULL_BLOCKS == len(set(written))  # 50 distinct blocks, 25 fit
    assert most_bytes <= engine.offload.disk.capacity_bytes
    assert on_disk(engine) == set(written[-25:])  # the oldest 25 went first
    assert engine.offload.disk.bytes_used == 25 * file_bytes


def test_a_pinned_cache_point_outlives_newer_blocks_until_its_lifetime_ends(tiny_model, prompts, tmp_path):
    engine, file_bytes = make_engine(tiny_model, tmp_path, n_files=25)
    point = CachePoint(num_tokens=3 * B, ttl_s=3600)  # the first prompt's first 3 blocks, for an hour
    written, most_bytes = run(engine, prompts, {0: point})
    pinned = written[PREFILL_BLOCKS - 3 : PREFILL_BLOCKS]  # the chain's head: written last of the prefill
    assert most_bytes <= engine.offload.disk.capacity_bytes
    assert on_disk(engine) == set(pinned) | set(written[-22:])  # the pins kept, the oldest unpinned out
    engine.offload.disk.clock.now += 3600  # the hour is over: the pins are the oldest files now
    fresh = [torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(9)).tolist()]
    newer, _ = run(engine, fresh)  # 10 new blocks push out the 10 least recently used: the 3 pins first
    assert on_disk(engine) == set(written[-15:]) | set(newer)


def test_a_disk_size_needs_a_folder_and_room_for_a_block(tiny_model, tmp_path):
    model = tiny_model("llama_gqa")
    file_bytes = LLMEngine(model, num_blocks=12, block_size=B, kv_offload_dir=tmp_path).offload.disk.file_bytes
    cases = [(dict(kv_offload_disk_size="1GiB"), "give kv_offload_dir too"),
             (dict(kv_offload_dir=tmp_path, kv_offload_disk_size="lots"), "kv_offload_disk_size: .* must be a size"),
             (dict(kv_offload_dir=tmp_path, kv_offload_disk_size=file_bytes - 1), f"holds no block .*{file_bytes} bytes")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            LLMEngine(model, num_blocks=12, block_size=B, **kwargs)
    whole = LLMEngine(model, num_blocks=12, block_size=B, kv_offload_dir=tmp_path, kv_offload_disk_size=file_bytes)
    assert whole.offload.disk.capacity_bytes == file_bytes
    assert LLMEngine(model, num_blocks=12, block_size=B, kv_offload_dir=tmp_path).offload.disk.capacity_bytes is None


def test_a_fractional_disk_size_is_of_the_disk_s_free_space(tiny_model, tmp_path, monkeypatch):
    from minillm.serving.kv_tiers import offload

    free, disk_usage = 10**9, shutil.disk_usage
    monkeypatch.setattr(offload.shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=free))
    engine = LLMEngine(tiny_model("llama_gqa"), num_blocks=12, block_size=B, kv_offload_dir=tmp_path,
                       kv_offload_disk_size="0.25")
    assert engine.offload.disk.capacity_bytes == free // 4


def test_a_chain_larger_than_the_bound_keeps_its_head(tiny_model, prompts, tmp_path):
    """A 1-hour cache point over a prompt of 10 blocks, a bound of 6 files: a restarted engine reads the
    head's 6 blocks (a lookup starts at the head; the tail alone would be useless)."""
    engine, _ = make_engine(tiny_model, tmp_path, n_files=6)
    written, _ = run(engine, prompts[:1], {0: CachePoint(num_tokens=PROMPT, ttl_s=3600)})
    chain = written[:PREFILL_BLOCKS][::-1] + written[PREFILL_BLOCKS:]
    assert on_disk(engine) == set(chain[:6])
    restarted, _ = make_engine(tiny_model, tmp_path, n_files=6)
    restarted.offload.hardware = HardwareProfile("slow", peak_flops=1e3, mem_bandwidth=1e3)  # loads win
    restarted.offload.record_prefill = lambda chunks, seconds: None
    assert restarted.generate([prompts[0]], GREEDY)[0].num_cached_tokens == 6 * B
