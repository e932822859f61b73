"""The engine with KV tiers, on a tiny model with block_size 4 and a pool that evicts.

Oracles: the tokens of the same prompts on an engine without any cache (greedy, and seeded
sampling: the same generator draws, so any wrong K/V shows as other tokens); the salted block
hashes computed here with hashlib; the tiers' own contents.

Four prompts of 37 tokens (9 full blocks, the last token always computed) run one at a time
through a pool of 12 blocks: each request needs 10, so each evicts the one before. The tiny model
prefills so fast that the cost model rightly prefers recompute; ``SLOW`` hardware makes a load
the cheaper choice where a test needs loads, ``FAST`` hardware makes recompute win everywhere
(with the engine's measured prefill efficiency left out, which would otherwise scale both to this
machine's real prefill: ``test_measured_prefill_efficiency_scales_the_recompute_prediction``).
"""

import errno
import hashlib
import warnings

import pytest
import torch

import minillm
from minillm import LLMEngine, SamplingParams
from minillm.block_hash import block_hashes
from minillm.hardware import HardwareProfile
from minillm.serving.kv_tiers import CachePoint, disk as disk_module
from minillm.serving.step_trace import chrome_trace_events
from minillm.whatif import prefill_floor_s

B, PROMPT, N_PROMPTS = 4, 37, 4
SLOW = HardwareProfile("slow", peak_flops=1e3, mem_bandwidth=1e3)
FAST = HardwareProfile("fast", peak_flops=1e18, mem_bandwidth=1e18)
GREEDY = SamplingParams(max_new_tokens=5)
SEEDED = SamplingParams(max_new_tokens=5, temperature=0.9, seed=11)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (PROMPT,), generator=g).tolist() for _ in range(N_PROMPTS)]


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama_gqa")


def uncached(model, prompts, params):
    engine = LLMEngine(model, num_blocks=64, block_size=B, eos_token_ids=(), enable_prefix_caching=False)
    return [o.token_ids for o in engine.generate(prompts, params)]


def tiered(model, hardware=SLOW, **tiers):
    engine = LLMEngine(model, num_blocks=12, block_size=B, eos_token_ids=(), max_num_seqs=1, **tiers)
    if engine.offload is not None:  # the profile alone decides: no measured prefill scales it
        engine.offload.hardware = hardware
        engine.offload.record_prefill = lambda chunks, seconds: None
    return engine


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_equal_the_uncached_run_with_host_and_disk_hits(model, prompts, params, tmp_path):
    want = uncached(model, prompts, params)
    engine = tiered(model, kv_offload_memory="10KiB", kv_offload_dir=tmp_path)  # host: 5 blocks of 2 KiB
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    outs = engine.generate(prompts[::-1], params)[::-1]  # the most recently evicted first: some are in host memory
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [36] * N_PROMPTS  # 9 blocks each, from some tier
    counts = engine.offload.counts
    assert counts["host_hits"] > 0 and counts["disk_hits"] > 0
    assert counts["loaded_blocks"] == counts["host_hits"] + counts["disk_hits"] and counts["recomputed_blocks"] == 0
    assert engine.offload.host.bytes_used <= 10 * 1024


def test_a_restarted_engine_hits_the_disk_tier(model, prompts, tmp_path):
    want = uncached(model, prompts, GREEDY)
    first = tiered(model, kv_offload_dir=tmp_path)
    assert [o.token_ids for o in first.generate(prompts, GREEDY)] == want
    first.close()
    first.close()  # idempotent
    restarted = tiered(model, kv_offload_dir=tmp_path)
    outs = restarted.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [36] * N_PROMPTS
    assert restarted.offload.counts["disk_hits"] == 4 * 9


def test_fast_hardware_recomputes_and_the_trace_shows_both_numbers(model, prompts, tmp_path):
    want = uncached(model, prompts, GREEDY)
    tiered(model, kv_offload_dir=tmp_path).generate(prompts, GREEDY)
    for hardware, choice in ((FAST, "recompute"), (SLOW, "load")):
        engine = tiered(model, hardware, kv_offload_dir=tmp_path)
        outs = engine.generate(prompts[:1], GREEDY)
        assert outs[0].token_ids == want[0]
        (decision,) = [d for step in engine.steps for d in step.tier_decisions]
        assert (decision.tier, decision.first_block, decision.num_blocks, decision.choice) == ("disk", 0, 9, choice)
        assert decision.num_bytes == 9 * engine.cache.bytes_per_block
        assert decision.load_ms > 0 and decision.recompute_ms > 0
        assert (decision.load_ms < decision.recompute_ms) == (choice == "load")
        assert outs[0].num_cached_tokens == (36 if choice == "load" else 0)
        assert decision.loaded_blocks == (9 if choice == "load" else 0)
        events = chrome_trace_events(engine.steps, engine.requests)
        traced = [e["args"]["tier_decisions"] for e in events if "tier_decisions" in e.get("args", {})]
        assert traced == [[{"request": "0", "tier": "disk", "blocks": 9, "bytes": decision.num_bytes,
                            "load_ms": round(decision.load_ms, 3), "recompute_ms": round(decision.recompute_ms, 3),
                            "choice": choice, "loaded_blocks": decision.loaded_blocks}]]


def test_measured_prefill_efficiency_scales_the_recompute_prediction(model, tmp_path):
    engine = LLMEngine(model, num_blocks=12, block_size=B, kv_offload_dir=tmp_path)
    offload = engine.offload
    offload.hardware = SLOW
    assert offload.prefill_efficiency == 1.0  # nothing measured: the roofline floor itself
    floor_s = prefill_floor_s(model.config, SLOW, 16, 4, 0) + prefill_floor_s(model.config, SLOW, 8, 4, 16)
    first_floor_s = prefill_floor_s(model.config, SLOW, 16, 4, 0)
    offload.record_prefill([(0, 16)], seconds=100 * first_floor_s)  # the first: a warm-up's one-time costs
    assert offload.prefill_efficiency == pytest.approx(0.01)  # the only measurement so far
    offload.record_prefill([(0, 16), (16, 8)], seconds=4 * floor_s)  # a quarter of the roofline: the first left out
    assert offload.prefill_efficiency == pytest.approx(0.25)
    decision = offload._decide("r", "disk", 2, 3)
    assert decision.recompute_ms == pytest.approx(4e3 * prefill_floor_s(model.config, SLOW, 12, 4, 8))


def salted(seed: bytes, salt: str) -> bytes:
    return hashlib.sha256(seed + b"cache_salt" + salt.encode()).digest()


def test_different_salts_never_share_in_the_pool(model, prompts):
    engine = LLMEngine(model, num_blocks=64, block_size=B, eos_token_ids=())
    runs = [("alice", 0), ("bob", 0), ("alice", 36), (None, 0), (None, 36), ("bob", 36)]
    for salt, cached in runs:
        rid = engine.add_request(prompts[0], GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.requests[rid].num_cached_tokens == cached, salt
    seed = engine.cache.allocator.seed
    for salt in ("alice", "bob"):  # each tenant's chain is rooted at its own salted seed
        assert set(block_hashes(prompts[0], B, salted(seed, salt))) <= set(engine.cache.allocator.cached)
    assert set(block_hashes(prompts[0], B, seed)) <= set(engine.cache.allocator.cached)


def test_different_salts_never_share_on_disk(model, prompts, tmp_path):
    first = tiered(model, kv_offload_dir=tmp_path)
    first.add_request(prompts[0], GREEDY, cache_salt="alice")
    while first.has_unfinished_requests():
        first.step()
    first.close()
    for salt, cached in (("bob", 0), (None, 0), ("alice", 36)):
        engine = tiered(model, kv_offload_dir=tmp_path)
        rid = engine.add_request(prompts[0], GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.requests[rid].num_cached_tokens == cached, salt


def test_another_model_dtype_or_block_size_never_hits_the_disk_tier(tiny_model, prompts, tmp_path):
    model = tiny_model("llama_gqa")
    tiered(model, kv_offload_dir=tmp_path).generate(prompts[:1], GREEDY)
    others = [dict(model=tiny_model("qwen2")), dict(model=minillm.load_model(model.source, device="cpu", dtype=torch.bfloat16)),
              dict(model=model, block_size=8)]
    for other in others:
        kwargs = dict(num_blocks=12, block_size=B, eos_token_ids=(), kv_offload_dir=tmp_path) | other
        engine = LLMEngine(kwargs.pop("model"), **kwargs)
        engine.offload.hardware = SLOW
        assert engine.generate(prompts[:1], GREEDY)[0].num_cached_tokens == 0
        assert engine.offload.counts["disk_hits"] == 0


def test_a_full_disk_warns_once_and_recomputes(model, prompts, tmp_path, monkeypatch):
    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "_write_block", no_space)
    want = uncached(model, prompts, GREEDY)
    engine = tiered(model, kv_offload_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == want
    assert [str(w.message).count("cannot write") for w in caught] == [1]
    assert engine.offload.counts["disk_writes"] == engine.offload.counts["disk_hits"] == 0


class Clock:
    now = 1e9

    def __call__(self):
        return self.now


def test_cache_point_pins_blocks_in_the_host_tier_until_its_time(model, prompts):
    clock = Clock()
    engine = tiered(model, kv_offload_memory="6KiB")  # 3 blocks
    engine.offload.clock = engine.offload.host.clock = clock
    point = CachePoint(num_tokens=10, ttl_s=100)  # 10 // 4 = 2 full blocks pinned
    pinned = block_hashes(prompts[0][:8], B, engine.cache.allocator.seed)
    first = engine.generate([prompts[0]], GREEDY)  # (generate takes no cache point: add it by hand below)
    assert first[0].num_cache_write_tokens == 0
    rid = engine.add_request(prompts[0], GREEDY, cache_point=point)
    while engine.has_unfinished_requests():
        out = engine.step()
    assert out[0].num_cache_write_tokens == 0 and out[0].num_cached_tokens == 36  # all read from the pool
    engine.generate(prompts[1:], GREEDY)  # evicts prompt 0 from the pool, through the 3-block host tier
    assert all(h in engine.offload.host for h in pinned)
    clock.now += 101  # the pin has expired
    engine.generate(prompts[1:], GREEDY)
    assert not any(h in engine.offload.host for h in pinned)
    assert engine.requests[rid].cache_points == (point,)


@pytest.mark.parametrize("order", [1, -1], ids=["1h-then-5m", "5m-then-1h"])
def test_each_cache_point_pins_its_own_prefix_for_its_own_ttl(model, prompts, order):
    """Two marks, Anthropic style: the first 8 tokens for an hour, the whole prompt for 5 minutes. The first
    prefix's 2 blocks stay pinned for the hour (not the later mark's 5 minutes), the rest for 5 minutes."""
    clock = Clock()
    engine = tiered(model, kv_offload_memory="6KiB")  # 3 blocks: the 2 of the hour, and one more
    engine.offload.clock = engine.offload.host.clock = clock
    points = [CachePoint(num_tokens=8, ttl_s=3600), CachePoint(num_tokens=PROMPT, ttl_s=300)][::order]
    rid = engine.add_request(prompts[0], GREEDY, cache_point=points)
    hashes = block_hashes(prompts[0], B, engine.cache.allocator.seed)  # 9 full blocks
    assert engine.offload.pins == {h: clock.now + (3600 if i < 2 else 300) for i, h in enumerate(hashes)}
    while engine.has_unfinished_requests():
        out = engine.step()
    assert out[0].num_cache_write_tokens == 36  # the longest point's full blocks, all computed
    assert engine.requests[rid].cache_points == tuple(sorted(points, key=lambda p: p.num_tokens))
    clock.now += 301  # the 5 minutes are over, the hour is not
    engine.generate(prompts[1:], GREEDY)  # evicts prompt 0 from the pool through the 3-block host tier
    assert [h in engine.offload.host for h in hashes] == [True, True] + [False] * 7
    clock.now += 3600  # the hour is over too
    engine.generate(prompts[1:], GREEDY)
    assert not any(h in engine.offload.host for h in hashes)


def test_num_cache_write_tokens_counts_the_cache_points_computed_blocks(model, prompts):
    engine = LLMEngine(model, num_blocks=64, block_size=B, eos_token_ids=())
    results = []
    for num_tokens in (10, 30, 100):  # 8 tokens written; then 28, of which 8... all 36 cached: 0
        rid = engine.add_request(prompts[0], GREEDY, cache_point=CachePoint(num_tokens, 60))
        while engine.has_unfinished_requests():
            out = engine.step()
        results.append((out[0].num_cached_tokens, out[0].num_cache_write_tokens))
        assert engine.requests[rid].finished
    # first: nothing cached, 8 of its 10 tokens in full blocks written; then everything is read
    assert results == [(0, 8), (36, 0), (36, 0)]


def test_bad_tier_arguments_are_one_line_errors(model, tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [(dict(kv_offload_memory="lots"), "kv_offload_memory"), (dict(kv_offload_memory=100), "holds no block"),
             (dict(kv_offload_dir=a_file), "is a file"),
             (dict(kv_offload_dir=tmp_path, enable_prefix_caching=False), "enable_prefix_caching")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            LLMEngine(model, num_blocks=12, block_size=B, **kwargs)
    engine = LLMEngine(model, num_blocks=12, block_size=B)
    for kwargs, match in ((dict(cache_salt=""), "cache_salt"), (dict(cache_salt=5), "cache_salt"),
                          (dict(cache_point=10), "CachePoint"), (dict(cache_point=[CachePoint(4), 10]), "CachePoint"),
                          (dict(cache_point="5m"), "CachePoint")):
        with pytest.raises(ValueError, match=match):
            engine.add_request([1, 2, 3], GREEDY, **kwargs)
    assert engine.offload is None and not engine.requests
    monkeypatch.setattr(disk_module.os, "access", lambda *a: False)
    with pytest.raises(ValueError, match="permission denied"):
        LLMEngine(model, num_blocks=12, block_size=B, kv_offload_dir=tmp_path / "locked")
