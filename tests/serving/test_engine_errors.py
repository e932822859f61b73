"""Bad input to the engine: a clear ValueError before anything is queued, or a request that
finishes with a reason and a message; and afterwards no block is held (every ref_count 0)."""

import pytest
import torch

from minillm import KVCache, LLMEngine, SamplingParams, generate

B = 4


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama_gqa")  # context 128, vocab 128


def assert_nothing_held(engine):
    pool = engine.cache.allocator
    assert all(block.ref_count == 0 for block in pool.blocks) and not pool.block_tables
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("prompt, knobs, match", [
    ([1] * 129, {}, "model's context is 128"),
    ([1] * 16, dict(num_blocks=4), "whole KV cache pool holds 4 blocks"),
    ([], {}, "empty"),
    ("hello", {}, r"add_request takes token ids, not text; encode it first: engine.add_request\(tok.encode"),
    ([1, 2, 128], {}, r"must be in \[0, 128\)"),
    ([-1, 2], {}, r"must be in \[0, 128\)"),
    ([[1, 2], [3, 4]], {}, r"add_request takes one prompt.*engine.generate"),
    (torch.tensor([[1, 2], [3, 4]]), {}, r"add_request takes one prompt.*engine.generate"),
    ([1.5, 2.0], {}, "integer token ids"),
    ([1] * 40, dict(max_num_batched_tokens=32, enable_chunked_prefill=False), "chunked prefill is off"),
])
def test_bad_prompts_are_value_errors(model, prompt, knobs, match):
    engine = LLMEngine(model, **{"num_blocks": 64, "block_size": B, **knobs})
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt)
    assert not engine.requests and not engine.has_unfinished_requests()
    assert_nothing_held(engine)


@pytest.mark.parametrize("knobs, match", [
    (dict(block_size=16, max_num_batched_tokens=8), "smaller than one block"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive int"),
    (dict(block_size=0), "block_size must be a positive int"),
    (dict(num_blocks=0), "num_blocks must be a positive int"),
    (dict(num_blocks=None, kv_cache_memory="1KiB"), "holds no block"),
    (dict(num_blocks=None, kv_cache_memory="lots"), "KV cache memory must be a size"),
    (dict(num_blocks=None, kv_cache_memory=10**20), "more than the free memory"),
    (dict(num_blocks=None, kv_cache_memory="1000TiB"), "more than the free memory"),
    (dict(num_blocks=None, kv_cache_memory=1.5), r"fraction of free memory must be in \(0, 1\]"),
    (dict(num_blocks=8, kv_cache_memory="64MiB"), "give kv_cache_memory .* or num_blocks .*, not both"),
    (dict(num_blocks=None, kv_cache_memory=0), "KV cache memory must be > 0"),
])
def test_bad_knobs_are_value_errors(model, knobs, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(model, **{"num_blocks": 8, **knobs})


def test_bad_params_and_ids(model):
    engine = LLMEngine(model, num_blocks=16, block_size=B, eos_token_ids=())
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request([1, 2], {"temperature": 0.5})
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1, 2], SamplingParams(stop=["x"]))  # stop strings need one
    engine.add_request([1, 2, 3], request_id="x")
    with pytest.raises(ValueError, match="'x' is already in use"):
        engine.add_request([4, 5], request_id="x")
    assert engine.requests["x"].prompt_ids == [1, 2, 3] and len(engine.scheduler.waiting) == 1
    with pytest.raises(ValueError, match="no request with id 'nope'"):
        engine.abort_request("nope")
    engine.abort_request("x")  # a waiting request: aborted without ever running
    assert engine.requests["x"].finish_reason == "abort" and not engine.has_unfinished_requests()
    engine.abort_request("x")  # aborting a finished request does nothing
    assert engine.requests["x"].finish_reason == "abort"
    assert_nothing_held(engine)


def test_an_auto_id_skips_ids_the_caller_took(model):
    engine = LLMEngine(model, num_blocks=16, block_size=B)
    engine.add_request([1, 2], request_id="0")
    assert engine.add_request([3, 4]) not in ("0",)


def test_generate_checks_every_prompt_before_queueing_any(model):
    engine = LLMEngine(model, num_blocks=16, block_size=B)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        engine.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 2], []])  # the first prompt is good, the second not
    with pytest.raises(ValueError, match="list of prompts"):
        engine.generate("hello")
    assert not engine.has_unfinished_requests() and not engine.scheduler.waiting
    assert_nothing_held(engine)


def test_a_pool_too_small_for_the_output_finishes_length_with_a_message(model):
    # 4 blocks of 4 = 16 positions: a 10-token prompt has room for 7 tokens (the 7th is never decoded),
    # exactly what generate gives with a 16-position KV cache.
    engine = LLMEngine(model, num_blocks=4, block_size=B, eos_token_ids=())
    params = SamplingParams(max_new_tokens=20)
    (out,) = engine.generate([list(range(10))], params)
    cache = KVCache.for_model(model, max_seq_len=16)
    alone = list(generate(model, list(range(10)), params, cache=cache, eos_token_ids=()))
    assert out.token_ids == [s.token_id for s in alone] and len(out.token_ids) == 7
    assert out.finish_reason == "length" and "KV cache pool is full" in out.message
    assert alone[-1].finish_reason == "cache_full"
    assert_nothing_held(engine)


def test_the_model_context_ends_a_request_with_length(model):
    engine = LLMEngine(model, num_blocks=64, block_size=B, eos_token_ids=())
    (out,) = engine.generate([[1] * 125], SamplingParams(max_new_tokens=10))
    assert len(out.token_ids) == 4 and out.finish_reason == "length" and "context of 128" in out.message
    assert_nothing_held(engine)


def test_abort_of_a_running_request_frees_its_blocks_at_once(model):
    engine = LLMEngine(model, num_blocks=32, block_size=B, eos_token_ids=())
    params = SamplingParams(max_new_tokens=6)
    a = engine.add_request(list(range(30)), params)
    b = engine.add_request(list(range(40, 49)), params)
    engine.step()
    engine.step()
    pool = engine.cache.allocator
    held_by_a = len(pool.block_tables[a])
    used = pool.num_used_blocks
    out = engine.abort_request(a)
    assert a not in pool.block_tables and pool.num_used_blocks == used - held_by_a
    assert out.finished and out.finish_reason == "abort" and out.new_token_ids == [] and len(out.token_ids) == 2
    assert a not in [o.request_id for o in engine.step()]  # the abort was its last output
    ra = engine.requests[a]
    assert ra.finished and ra.finish_reason == "abort" and ra.message and len(ra.output_ids) == 2
    while engine.has_unfinished_requests():
        engine.step()
    alone = [s.token_id for s in generate(model, list(range(40, 49)), params, eos_token_ids=())]
    assert engine.requests[b].output_ids == alone
    assert_nothing_held(engine)


def test_preempted_requests_in_a_tiny_pool_all_finish(model):
    # Two requests outgrow a 6-block pool together: one is preempted, recomputed, and both finish.
    engine = LLMEngine(model, num_blocks=6, block_size=B, eos_token_ids=())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (7,), generator=g).tolist() for _ in range(2)]
    params = SamplingParams(max_new_tokens=12)
    outs = engine.generate(prompts, params)
    assert sum(r.num_preemptions for r in engine.requests.values()) >= 1
    for out, prompt in zip(outs, prompts):
        assert out.token_ids == [s.token_id for s in generate(model, prompt, params, eos_token_ids=())]
    assert_nothing_held(engine)
