"""Random engines, random traffic (hypothesis): every request still gets its tokens from
``generate`` alone, and the pool ends empty.

Knobs (block_size, pool size, token budget, max_num_seqs, chunked prefill, prefix caching)
and traffic (prompts that often share a prefix, arrival steps, an occasional abort) are
drawn at random, so preemption, pool-full finishes, prefix hits on blocks of finished or
preempted requests, and 1-token chunks all occur. A request that the pool could not hold
(finish "length" with a message) must have a prefix of its tokens alone.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import LLMEngine, SamplingParams, generate

BASE = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0)).tolist()
_alone: dict[tuple, list[int]] = {}


def alone(model, prompt, max_new):
    key = (tuple(prompt), max_new)
    if key not in _alone:
        _alone[key] = [s.token_id for s in generate(model, prompt, SamplingParams(max_new_tokens=max_new),
                                                     eos_token_ids=())]
    return _alone[key]


knobs_st = st.fixed_dictionaries(dict(
    block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(4, 40), max_num_batched_tokens=st.integers(8, 64),
    max_num_seqs=st.sampled_from([1, 2, 3, 32]), enable_chunked_prefill=st.booleans(),
    enable_prefix_caching=st.booleans()))
prompt_st = st.one_of(st.integers(1, 40).map(lambda n: BASE[:n]),  # shares a prefix with the others
                      st.lists(st.integers(0, 127), min_size=1, max_size=40))
request_st = st.tuples(st.integers(0, 5), prompt_st, st.integers(1, 6))  # (arrival step, prompt, max_new)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(knobs=knobs_st, plan=st.lists(request_st, min_size=1, max_size=6), aborts=st.lists(st.integers(0, 12)))
def test_random_traffic_gets_alone_tokens(tiny_model, knobs, plan, aborts):
    model = tiny_model("llama_gqa")
    engine = LLMEngine(model, eos_token_ids=(), **knobs)
    plan = sorted(plan, key=lambda r: r[0])
    expected, aborted, step = {}, set(), 0
    while plan or engine.has_unfinished_requests():
        while plan and plan[0][0] <= step:
            _, prompt, max_new = plan.pop(0)
            try:
                expected[engine.add_request(prompt, SamplingParams(max_new_tokens=max_new))] = (prompt, max_new)
            except ValueError:  # longer than the pool holds, or than the budget without chunked prefill
                pass
        if step in aborts and expected:
            rid = sorted(expected)[step % len(expected)]
            aborted |= {rid} if not engine.requests[rid].finished else set()
            engine.abort_request(rid)
        engine.step()
        step += 1
        assert step < 500, f"no progress: {engine!r}"
    for rid, (prompt, max_new) in expected.items():
        request, tokens = engine.requests[rid], alone(model, prompt, max_new)
        if rid in aborted:
            assert request.finish_reason == "abort"
        elif request.message:  # the pool could not hold it
            assert request.finish_reason == "length" and request.output_ids == tokens[: len(request.output_ids)]
        else:
            assert request.output_ids == tokens, f"request {rid}: {request!r}"
    pool = engine.cache.allocator
    assert all(b.ref_count == 0 for b in pool.blocks) and not pool.block_tables
