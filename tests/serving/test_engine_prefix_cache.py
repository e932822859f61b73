"""Prefix caching inside the engine, on a tiny model with block_size 4.

A second request with the same 23-token prompt hits (23 - 1) // 4 = 5 full blocks
(20 tokens: the last prompt token is always computed), points its table at the same
physical blocks (ref_count 2), and still generates the same tokens as alone. When both
finish, the blocks stay cached with ref_count 0, and a request that needs the pool
evicts them least recently freed first: a request frees its table tail first, so the
prompt's head blocks are the last to go and can still be hit.
"""

import torch

from minillm import LLMEngine, SamplingParams, generate

B, MAX_NEW = 4, 4


def test_shared_prompt_hits_shares_and_is_evicted_lru(tiny_model):
    model = tiny_model("llama_gqa")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 128, (23,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=MAX_NEW)
    expected = [s.token_id for s in generate(model, prompt, params, eos_token_ids=())]
    engine = LLMEngine(model, num_blocks=16, block_size=B, eos_token_ids=())
    pool = engine.cache.allocator

    a = engine.add_request(prompt, params)
    engine.step()  # a's prompt computed: its 5 full blocks are named by their hashes
    b = engine.add_request(prompt, params)
    engine.step()
    ra, rb = engine.requests[a], engine.requests[b]
    assert ra.num_cached_tokens == 0 and rb.num_cached_tokens == (23 - 1) // B * B == 20
    shared = pool.block_tables[a][:5]
    assert pool.block_tables[b][:5] == shared and pool.block_tables[b][5] not in pool.block_tables[a]
    assert [pool.blocks[i].ref_count for i in shared] == [2] * 5
    assert engine.steps[1].scheduled == ((a, 0, 1), (b, 3, 0))  # b prefilled only its last 3 tokens

    while engine.has_unfinished_requests():
        engine.step()
    assert ra.output_ids == rb.output_ids == expected
    for i in shared:  # cached and free
        block = pool.blocks[i]
        assert block.ref_count == 0 and pool.cached[block.block_hash] == i and i in pool.free_queue
    assert all(block.ref_count == 0 for block in pool.blocks) and not pool.block_tables

    # LRU: the free queue is the never-used blocks, a's tail, b's tail, then the shared blocks last to first.
    order = list(pool.free_queue)
    assert [order.index(i) for i in reversed(shared)] == sorted(order.index(i) for i in shared)
    assert order[-5:] == shared[::-1]
    hashes = [pool.blocks[i].block_hash for i in shared]
    k = order.index(shared[3]) + 1  # a prompt of k blocks evicts everything up to shared[3]: shared[4], shared[3]
    other = torch.randint(0, 128, (k * B - 1,), generator=g).tolist()
    c = engine.add_request(other, SamplingParams(max_new_tokens=1))
    engine.step()
    assert engine.requests[c].num_cached_tokens == 0 and engine.requests[c].finished
    assert [h in pool.cached for h in hashes] == [True, True, True, False, False]  # the tail went first
    assert pool.block_tables == {} and shared[3] in pool.free_queue  # (now holding c's tokens)

    d = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    rd = engine.requests[d]
    assert rd.num_cached_tokens == 3 * B and pool.blocks[shared[0]].ref_count == 0
    assert rd.output_ids == expected
