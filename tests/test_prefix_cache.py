"""The prefix cache: transparent (same tokens, logits within 1e-5), hit counts by the rule,
isolated between models, collision-proof, LRU eviction of leaves, locks held while running.

Tiny random models and block_size 4 keep every case cheap.
"""

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import KVCache, SamplingParams, generate, load_model, prefill
from minillm.block_hash import block_hashes, hash_block, model_seed, short
from minillm.prefix_cache import PrefixCache

B = 4  # block_size in these tests


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for name, seed in (("llama_gqa", 0), ("gpt2", 0), ("llama_other", 1)):
        family, kwargs = CONFIGS[name if name != "llama_other" else "llama_gqa"]
        dirs[name] = save_hf(build_hf(family, kwargs, seed=seed), tmp_path_factory.mktemp(name))
    return dirs


@pytest.fixture(scope="module")
def models(model_dirs):
    return {name: load_model(folder, device="cpu") for name, folder in model_dirs.items()}


@pytest.fixture
def model(models):
    return models["llama_gqa"]


class Recorder:
    """A stand-in for minillm's Trace: collects (kind, fields)."""

    def __init__(self):
        self.events = []

    def record(self, kind, **fields):
        self.events.append((kind, fields))

    def kinds(self):
        return [k for k, _ in self.events]


def run(model, prompt, prefix_cache=None, max_new_tokens=3):
    """Greedy generate; returns (tokens, logits [n, vocab], cached_tokens), logits caught at the LM head."""
    logits = []
    handle = model.lm_head.register_forward_hook(lambda mod, inp, out: logits.append(out[0, -1].float().clone()))
    try:
        steps = list(generate(model, prompt, SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=()),
                              eos_token_ids=(), prefix_cache=prefix_cache))
    finally:
        handle.remove()
    assert {s.cached_tokens for s in steps} == {steps[0].cached_tokens}
    assert steps[0].cached_tokens + steps[0].prefill_tokens == len(prompt)
    return [s.token_id for s in steps], torch.stack(logits), steps[0].cached_tokens


def assert_transparent(model, prompt, prefix_cache):
    """Run ``prompt`` with the cache and without; same tokens, logits within 1e-5. Returns cached_tokens."""
    tokens, logits, cached = run(model, prompt, prefix_cache)
    ref_tokens, ref_logits, ref_cached = run(model, prompt)
    assert ref_cached == 0
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    return cached


def assert_invariants(pc: PrefixCache):
    s = pc.stats
    assert s.hit_tokens % pc.block_size == 0 and 0 <= s.hit_tokens <= s.query_tokens
    assert s.blocks == len(pc) and s.bytes == sum(r["bytes"] for r in pc.blocks())
    assert pc.capacity_blocks is None or s.blocks <= pc.capacity_blocks
    assert pc.capacity_bytes is None or s.bytes <= pc.capacity_bytes
    by_hash = {pc.block(h).hash: pc.block(h) for h in list(pc._blocks)}
    for block in by_hash.values():  # every cached block's parent is cached too
        assert block.parent is None or block.parent in pc
        assert block.n_children == sum(1 for b in by_hash.values() if b.parent == block.hash)


def ids(*spans):
    """Token ids from (start, length) spans: ids((10, 5), (50, 3)) -> [10..14, 50..52]."""
    return [t for start, n in spans for t in range(start, start + n)]


# -- transparency and hit counts ----------------------------------------------------------------

# (first prompt, second prompt, cached tokens of the second); B = 4
CASES = {
    "shared prefix shorter than a block": (ids((10, 3), (60, 9)), ids((10, 3), (80, 9)), 0),
    "shared prefix exactly 2 blocks": (ids((10, 8), (60, 5)), ids((10, 8), (80, 5)), 8),
    "shared prefix 2 blocks - 1": (ids((10, 7), (60, 5)), ids((10, 7), (80, 5)), 4),
    "shared prefix 2 blocks + 1": (ids((10, 9), (60, 5)), ids((10, 9), (80, 5)), 8),
    "identical, 3 full blocks": (ids((10, 12)), ids((10, 12)), 8),
    "identical, 2 blocks + 2": (ids((10, 10)), ids((10, 10)), 8),
    "strict prefix of the cached one": (ids((10, 17)), ids((10, 10)), 8),
    "strict prefix, exactly 2 blocks": (ids((10, 17)), ids((10, 8)), 4),
    "prompt is exactly the shared 2 blocks": (ids((10, 8), (60, 6)), ids((10, 8)), 4),
    "divergence in the middle of a block": (ids((10, 6), (60, 6)), ids((10, 6), (80, 6)), 4),
    "single token prompt": (ids((10, 12)), ids((10, 1)), 0),
}


def expected_hit(cached_prompt, prompt, block_size=B):
    """The rule: full blocks of the common prefix, capped so one prompt token is prefilled."""
    common = 0
    while common < min(len(cached_prompt), len(prompt)) and cached_prompt[common] == prompt[common]:
        common += 1
    return min(common // block_size, (len(prompt) - 1) // block_size) * block_size


@pytest.mark.parametrize("family", ["llama_gqa", "gpt2"])
@pytest.mark.parametrize("case", list(CASES))
def test_cache_is_transparent_and_hits_follow_the_rule(models, family, case):
    model = models[family]
    first, second, hit = CASES[case]
    assert expected_hit(first, second) == hit  # the table agrees with the rule
    pc = PrefixCache(model, block_size=B)
    assert assert_transparent(model, first, pc) == 0
    assert assert_transparent(model, second, pc) == hit
    assert pc.stats.hit_tokens == hit and pc.stats.query_tokens == len(first) + len(second)
    assert_invariants(pc)


@pytest.mark.parametrize("length, hit", [(3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (13, 12)])
def test_same_prompt_twice_in_a_row(model, length, hit):
    pc = PrefixCache(model, block_size=B)
    prompt = ids((20, length))
    assert assert_transparent(model, prompt, pc) == 0
    assert assert_transparent(model, prompt, pc) == hit
    assert pc.stats.requests == 2 and pc.stats.hit_rate == hit / (2 * length)


def test_lookup_walk_and_trace_events(model):
    pc, trace = PrefixCache(model, block_size=B), Recorder()
    prompt = ids((10, 8), (60, 5))
    cache = KVCache.for_model(model, max_seq_len=32)
    req = pc.begin(model, prompt, cache, trace=trace)
    prefill(model, prompt[req.cached_tokens :], cache)
    pc.commit(model, req, cache, trace=trace)
    pc.end(req)
    assert trace.kinds() == ["prefix_lookup", "prefix_insert"]
    lookup, insert = trace.events[0][1], trace.events[1][1]
    assert lookup["blocks_matched"] == 0 and lookup["first_miss"] == 0 and lookup["stop"] == "miss"
    hashes = block_hashes(prompt, B, model_seed(model))
    assert insert["blocks"] == [short(h) for h in hashes] and insert["positions"] == (0, 12)

    trace = Recorder()
    second = ids((10, 8), (80, 5))
    cache = KVCache.for_model(model, max_seq_len=32)
    req = pc.begin(model, second, cache, trace=trace)
    assert cache.length == req.cached_tokens == 8 and req.prefill_tokens == 5
    assert [h in req.locked for h in hashes] == [True, True, False]
    assert [pc.block(h).ref_count for h in hashes[:2]] == [1, 1]
    pc.end(req)
    assert [pc.block(h).ref_count for h in hashes[:2]] == [0, 0]
    lookup = trace.events[0][1]
    assert (lookup["blocks_matched"], lookup["first_miss"], lookup["stop"]) == (2, 2, "miss")
    assert trace.events[1] == ("prefix_hit", {"blocks": [short(h) for h in hashes[:2]], "positions": (0, 8)})


def test_identical_prompt_stops_at_the_cap(model):
    pc, trace = PrefixCache(model, block_size=B), Recorder()
    prompt = ids((10, 12))
    run(model, prompt, pc)
    m = pc.match(model, prompt, trace=trace)
    assert (m.n_hit_blocks, m.first_miss, m.stop) == (2, 2, "cap")
    assert m.block_hashes[2] in pc  # cached, yet recomputed: its last token's logits are needed


# -- isolation ----------------------------------------------------------------------------------


def test_other_model_and_dtype_get_no_hits(models, model_dirs):
    model, prompt = models["llama_gqa"], ids((10, 13))
    pc = PrefixCache(model, block_size=B)
    run(model, prompt, pc)
    assert assert_transparent(models["llama_other"], prompt, pc) == 0
    bf16 = load_model(model_dirs["llama_gqa"], device="cpu", dtype="bfloat16")
    assert run(bf16, prompt, pc)[2] == 0
    assert model_seed(bf16) != model_seed(model) != model_seed(models["llama_other"])
    same = load_model(model_dirs["llama_gqa"], device="cpu")  # same file, same dtype: may share
    assert assert_transparent(same, prompt, pc) == 12


def test_extra_keys_separate_equal_prompts(model):
    pc, prompt = PrefixCache(model, block_size=B), ids((10, 9))
    for salt, hit in (("alice", 0), ("bob", 0), ("alice", 8)):
        cache = KVCache.for_model(model, max_seq_len=16)
        req = pc.begin(model, prompt, cache, extra_keys=(salt,))
        prefill(model, prompt[req.cached_tokens :], cache)
        pc.commit(model, req, cache)
        pc.end(req)
        assert req.cached_tokens == hit


def depth_only_hash(parent, token_ids, extra_keys):
    """A broken hash: ignores the tokens, so every prompt's block i collides."""
    return hashlib.sha256(parent + b"depth").digest()


def constant_hash(parent, token_ids, extra_keys):
    """A broken hash: every block of every prompt collides, whatever its depth."""
    return b"\0" * 32


def test_forced_collision_is_caught_by_the_token_comparison(model):
    pc, trace = PrefixCache(model, block_size=B, hash_fn=depth_only_hash), Recorder()
    run(model, ids((10, 9)), pc)
    assert len(pc) == 2
    assert assert_transparent(model, ids((30, 9)), pc) == 0
    assert pc.match(model, ids((30, 9)), trace=trace).stop == "collision"
    assert assert_transparent(model, ids((10, 4), (50, 5)), pc) == 4  # genuine first block still served


def test_forced_collision_across_depths_is_caught_by_the_parent_link(model):
    pc = PrefixCache(model, block_size=B, hash_fn=constant_hash)
    block = ids((10, 4))
    run(model, block + [90], pc)
    assert len(pc) == 1  # one key for everything
    # block 1 has block 0's tokens and (broken) hash, but K/V for other positions: not served
    assert assert_transparent(model, block + block + [90], pc) == 4


def test_real_hash_is_sha256_chain(model):
    seed = model_seed(model)
    h = block_hashes(ids((10, 9)), B, seed)
    assert len(h) == 2 and all(len(x) == 32 for x in h)
    assert h[0] == hash_block(seed, ids((10, 4))) and h[1] == hash_block(h[0], ids((14, 4)))
    assert block_hashes(ids((10, 9)), B, seed) == h  # deterministic, unlike hash() of str


# -- capacity, LRU, locks ------------------------------------------------------------------------


def test_lru_evicts_children_before_parents(model):
    pc, trace = PrefixCache(model, block_size=B, capacity_blocks=4), Recorder()
    a, b, c = ids((10, 9)), ids((30, 9)), ids((50, 9))
    run(model, a, pc)
    run(model, b, pc)
    pc.match(model, a)  # a lookup alone is a use: a is now more recently used than b
    ha, hb, hc = (block_hashes(p, B, model_seed(model)) for p in (a, b, c))
    cache = KVCache.for_model(model, max_seq_len=16)
    req = pc.begin(model, c, cache, trace=trace)
    prefill(model, c, cache)
    pc.commit(model, req, cache, trace=trace)
    pc.end(req)
    evicted = [f["block"] for k, f in trace.events if k == "prefix_evict"]
    assert evicted == [short(hb[1]), short(hb[0])]  # b's child, then b's root; a untouched
    assert all(h in pc for h in ha + hc) and not any(h in pc for h in hb)
    assert_invariants(pc)
    assert pc.stats.evictions == 2


def test_evicted_block_is_never_served(model):
    pc = PrefixCache(model, block_size=B, capacity_blocks=3)
    x, z = ids((10, 13)), ids((40, 5))
    hx = block_hashes(x, B, model_seed(model))
    run(model, x, pc)
    run(model, z, pc)  # needs one block: x's leaf goes
    assert hx[2] not in pc and hx[1] in pc
    assert assert_transparent(model, x, pc) == 8  # served up to the evicted block, not beyond
    assert_invariants(pc)


def test_child_without_its_parent_is_never_hit(model):
    pc = PrefixCache(model, block_size=B)
    x = ids((10, 13))
    run(model, x, pc)
    hx = block_hashes(x, B, model_seed(model))
    del pc._blocks[hx[0]]  # white box: pretend the root went missing
    assert hx[1] in pc and hx[2] in pc
    assert pc.match(model, x).n_hit_blocks == 0  # the walk stops at the first miss


def test_evict_takes_only_unlocked_leaves(model):
    pc = PrefixCache(model, block_size=B)
    x = ids((10, 13))
    run(model, x, pc)
    hx = block_hashes(x, B, model_seed(model))
    pc.lock(hx[:2])
    assert pc.evict(3) == [hx[2]]  # hx[1] is a leaf now, but locked
    pc.unlock(hx[:2])
    assert pc.evict(3) == [hx[1], hx[0]] and len(pc) == 0


def test_unlock_of_an_unlocked_block_raises(model):
    pc = PrefixCache(model, block_size=B)
    run(model, ids((10, 5)), pc)
    with pytest.raises(ValueError, match="not locked"):
        pc.unlock(list(pc._blocks))


def test_capacity_in_bytes(model):
    pc = PrefixCache(model, block_size=B, capacity_bytes=int(2.5 * PrefixCache(model, B).bytes_per_block))
    run(model, ids((10, 17)), pc)
    assert len(pc) == 2 and pc.stats.bytes == 2 * pc.bytes_per_block
    assert_invariants(pc)


def test_running_request_keeps_its_blocks(model):
    pc = PrefixCache(model, block_size=B, capacity_blocks=3)
    a, b = ids((10, 13)), ids((40, 13))
    ha = block_hashes(a, B, model_seed(model))
    run(model, a, pc)
    gen_a = generate(model, a, SamplingParams(max_new_tokens=5), prefix_cache=pc)
    next(gen_a)  # request A is running: it holds all three of its blocks
    assert [pc.block(h).ref_count for h in ha] == [1, 1, 1]
    assert assert_transparent(model, b, pc) == 0  # B finds no room, evicts nothing of A's
    assert all(h in pc for h in ha) and pc.stats.evictions == 0
    gen_a.close()  # the consumer stops early: the locks are released anyway
    assert [pc.block(h).ref_count for h in ha] == [0, 0, 0]
    run(model, b, pc)
    assert pc.stats.evictions == 3


def test_request_b_never_changes_request_a(model):
    a, b = ids((10, 11)), ids((10, 6), (70, 10))
    ref = run(model, a)
    pc = PrefixCache(model, block_size=B, capacity_blocks=4)
    first = run(model, a, pc)
    run(model, b, pc)
    again = run(model, a, pc)
    for got in (first, again):
        assert got[0] == ref[0]
        torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0)
    assert_invariants(pc)


def test_generate_needs_an_empty_cache_with_a_prefix_cache(model):
    pc, cache = PrefixCache(model, block_size=B), KVCache.for_model(model, max_seq_len=16)
    prefill(model, [1, 2], cache)
    with pytest.raises(ValueError, match="empty"):
        next(generate(model, [3, 4], cache=cache, prefix_cache=pc))


@pytest.mark.parametrize("kwargs", [dict(block_size=0), dict(capacity_blocks=-1), dict(capacity_bytes=-5)])
def test_bad_arguments(model, kwargs):
    with pytest.raises(ValueError):
        PrefixCache(model, **kwargs)


def test_reset_and_display(model):
    pc = PrefixCache(model, block_size=B, capacity_blocks=8)
    run(model, ids((10, 9)), pc)
    run(model, ids((10, 9)), pc)
    text = repr(pc)
    assert "blocks=2" in text and "hit_tokens=8/18" in text and "capacity=8 blocks" in text
    rows = pc.blocks()
    assert [r["index"] for r in rows] == [0, 1] and rows[1]["parent"] == rows[0]["block"]
    assert rows[0]["tokens"] == tuple(range(10, 14)) and rows[0]["ref_count"] == 0
    assert "<table>" in pc._repr_html_() and rows[0]["block"] in pc._repr_html_()
    pc.reset()
    assert len(pc) == 0 and pc.stats.requests == 0 and pc.stats.bytes == 0


# -- property test ------------------------------------------------------------------------------

STEMS = [ids((10, 7)), ids((10, 3), (40, 6)), ids((20, 9)), ids((10, 8), (30, 4))]


@st.composite
def workloads(draw):
    prompts = []
    for _ in range(draw(st.integers(2, 7))):
        stem = draw(st.sampled_from(STEMS))
        stem = stem[: draw(st.integers(0, len(stem)))]
        tail = draw(st.lists(st.integers(1, 4), max_size=6))  # small alphabet: many accidental matches
        prompts.append((stem + tail) or [1])
    return draw(st.sampled_from([2, 3, 4])), draw(st.sampled_from([None, 1, 2, 3, 5])), prompts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_property_outputs_equal_no_cache_outputs(model, workload):
    block_size, capacity, prompts = workload
    pc = PrefixCache(model, block_size=block_size, capacity_blocks=capacity)
    seen = []
    for prompt in prompts:
        tokens, logits, cached = run(model, prompt, pc, max_new_tokens=2)
        ref_tokens, ref_logits, _ = run(model, prompt, max_new_tokens=2)
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
        assert cached % block_size == 0 and cached <= len(prompt) - 1
        assert cached == 0 or any(p[:cached] == prompt[:cached] for p in seen)  # only seen prefixes
        rule = max([expected_hit(p, prompt, block_size) for p in seen], default=0)
        assert cached == rule if capacity is None else cached <= rule  # exact when nothing is evicted
        seen.append(prompt)
        assert_invariants(pc)
        assert all(r["ref_count"] == 0 for r in pc.blocks())
    assert pc.stats.requests == len(prompts) and pc.stats.query_tokens == sum(map(len, prompts))
