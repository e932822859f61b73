"""Parallel sampling (n > 1) in the engine: one prefill, then a fork.

A 23-token prompt with block_size 4 fills 5 full blocks and a partial one (3 of 4 positions).
After the prefill the request forks into n sequences whose block tables point at the same 6
blocks; the first decode of each writes position 23, inside the partial block, so each but the
last copies it first (copy on write). The full blocks stay shared (ref_count n) until the
sequences finish, and the pool then returns to all free.
"""

import pytest
import torch

from minillm import LLMEngine, SamplingParams, generate
from minillm.serving.request import sequence_id

B, N = 4, 3
PROMPT = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(3)).tolist()


def count_copies(engine) -> list[int]:
    """Blocks the cache copies at each step (copy on write), appended as the engine steps."""
    copies, copy_pending = [], engine.cache.copy_pending
    engine.cache.copy_pending = lambda: copies.append(copy_pending()) or copies[-1]
    return copies


def run(engine, rid):
    """Step to the end; the final output of each sequence of ``rid``, by index."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            if out.finished:
                final[out.index] = out
    return [final[i] for i in sorted(final)]


def test_greedy_n_sequences_equal_the_single_answer(tiny_model):
    model = tiny_model("llama_gqa")
    params = SamplingParams(max_new_tokens=6)
    alone = [s.token_id for s in generate(model, PROMPT, params, eos_token_ids=())]
    engine = LLMEngine(model, num_blocks=32, block_size=B, eos_token_ids=())
    outs = run(engine, engine.add_request(PROMPT, params, n=N))
    assert [o.index for o in outs] == [0, 1, 2]
    assert [o.token_ids for o in outs] == [alone] * N
    assert engine.cache.allocator.num_used_blocks == 0


def test_fork_shares_full_blocks_and_copies_only_the_partial_one(tiny_model):
    model = tiny_model("llama_gqa")
    engine = LLMEngine(model, num_blocks=32, block_size=B, eos_token_ids=(), enable_prefix_caching=False)
    pool, copies = engine.cache.allocator, count_copies(engine)
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=5, temperature=1.0, seed=7), n=N)

    engine.step()  # the prefill, once; then the fork: 3 tables, the same 6 blocks
    ids = [sequence_id(rid, i) for i in range(N)]
    tables = [pool.block_tables[i] for i in ids]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 6
    assert [pool.blocks[b].ref_count for b in tables[0]] == [N] * 6
    assert pool.num_used_blocks == 6

    engine.step()  # each writes position 23 into the partial block: two copies, the last writes in place
    tables = [pool.block_tables[i] for i in ids]
    full = tables[0][:5]
    assert all(t[:5] == full for t in tables)
    assert [pool.blocks[b].ref_count for b in full] == [N] * 5
    partial = [t[5] for t in tables]
    assert len(set(partial)) == N and all(pool.blocks[b].ref_count == 1 for b in partial)
    assert pool.num_used_blocks == 5 + N and copies == [0, N - 1]  # only the partial block, N - 1 copies

    outs = run(engine, rid)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks and not pool.block_tables
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the sequences differ (own generators)


def test_a_prompt_of_whole_blocks_copies_nothing(tiny_model):
    engine = LLMEngine(tiny_model("llama_gqa"), num_blocks=32, block_size=B, eos_token_ids=(),
                       enable_prefix_caching=False)
    pool, copies = engine.cache.allocator, count_copies(engine)
    rid = engine.add_request(PROMPT[:20], SamplingParams(max_new_tokens=3), n=N)
    engine.step()
    engine.step()  # position 20 starts a sixth block: each sequence takes a fresh one, no copy
    tables = [pool.block_tables[sequence_id(rid, i)] for i in range(N)]
    assert all(t[:5] == tables[0][:5] for t in tables) and len({t[5] for t in tables}) == N
    assert pool.num_used_blocks == 5 + N and copies == [0, 0]


def test_seeded_sequences_are_reproducible_and_sequence_i_is_seed_plus_i(tiny_model):
    model = tiny_model("llama_gqa")

    def sample(n, seed):
        engine = LLMEngine(model, num_blocks=32, block_size=B, eos_token_ids=())
        return [o.token_ids for o in run(engine, engine.add_request(
            PROMPT, SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed), n=n))]

    first = sample(N, 11)
    assert sample(N, 11) == first
    assert len({tuple(t) for t in first}) == N
    assert [sample(1, 11 + i)[0] for i in range(N)] == first  # vLLM's rule: child i draws with seed + i


def test_prefix_cache_raises_the_shared_counts(tiny_model):
    model = tiny_model("llama_gqa")
    engine = LLMEngine(model, num_blocks=32, block_size=B, eos_token_ids=())
    pool = engine.cache.allocator
    engine.add_request(PROMPT, SamplingParams(max_new_tokens=20), request_id="other")
    engine.step()
    engine.add_request(PROMPT, SamplingParams(max_new_tokens=3), request_id="x", n=N)
    engine.step()  # "x" hits the 5 full blocks of "other", prefills its last 3 tokens, forks
    full = pool.block_tables["other"][:5]
    assert pool.block_tables["x#2"][:5] == full
    assert [pool.blocks[b].ref_count for b in full] == [1 + N] * 5
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.num_used_blocks == 0


def test_max_tokens_one_finishes_every_sequence_at_the_fork(tiny_model):
    engine = LLMEngine(tiny_model("llama_gqa"), num_blocks=32, block_size=B, eos_token_ids=())
    outs = engine.step() if engine.add_request(PROMPT, SamplingParams(max_new_tokens=1), n=N) else None
    assert [(o.index, o.finished, len(o.token_ids)) for o in outs] == [(0, True, 1), (1, True, 1), (2, True, 1)]
    assert engine.cache.allocator.num_used_blocks == 0


def test_abort_stops_every_sequence(tiny_model):
    engine = LLMEngine(tiny_model("llama_gqa"), num_blocks=32, block_size=B, eos_token_ids=())
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=10), n=N)
    engine.step()
    engine.abort_request(rid)
    assert [s.finish_reason for s in engine.sequences(rid)] == ["abort"] * N
    assert not engine.has_unfinished_requests() and engine.cache.allocator.num_used_blocks == 0


def test_preempted_sequences_still_give_the_single_answer(tiny_model):
    model = tiny_model("llama_gqa")
    params = SamplingParams(max_new_tokens=8)
    alone = [s.token_id for s in generate(model, PROMPT, params, eos_token_ids=())]
    engine = LLMEngine(model, num_blocks=9, block_size=B, eos_token_ids=())  # too small for 3 x 8 blocks
    outs = run(engine, engine.add_request(PROMPT, params, n=N))
    assert sum(r.num_preemptions for r in engine.requests.values()) > 0
    assert [o.token_ids for o in outs] == [alone] * N
    assert engine.cache.allocator.num_used_blocks == 0


@pytest.mark.parametrize("n", [0, -1, 1.5, 33])
def test_n_outside_one_to_max_num_seqs_is_refused(tiny_model, n):
    engine = LLMEngine(tiny_model("llama_gqa"), num_blocks=32, block_size=B, max_num_seqs=32)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request(PROMPT, n=n)
