"""On the real default model, every request's greedy tokens in a batched engine run equal
its tokens from ``minillm.generate`` alone.

Sixteen prompts of 3 to 300 tokens (windows of one English passage, at different offsets)
arrive in three waves (some, a few steps, more), under chunked prefill and whole-prompt
prefill, in a pool so small that running requests get preempted and recomputed.
If a token differs, the message names the request, the step and the reference's top-2
logit gap there: a gap near float32 noise (~1e-4) is a near-tie, anything larger a bug.
"""

import pytest

from minillm import KVCache, LLMEngine, SamplingParams, generate, prefill

pytestmark = pytest.mark.large

PASSAGE = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour, and for two hundred years its "
    "keepers had climbed the same hundred and twelve steps every evening to light the lamp. The first lamp burned "
    "whale oil and had to be trimmed every few hours; the keeper slept in a chair beside it and woke to the smell "
    "of smoke. Later came paraffin, then a clockwork mechanism that turned the great glass lens so that the beam "
    "swept the sea once every ten seconds, a rhythm every sailor on the coast knew by heart. Ships counted the "
    "flashes to tell one light from another: three short and one long meant the harbour, two long meant the reef "
    "to the north. In winter storms the waves broke over the gallery and the whole tower shook, but the lens never "
    "cracked, because it floated in a bath of mercury that absorbed the shocks. The last keeper left in the spring "
    "of the year the light was automated. He locked the door, handed the key to an engineer from the city, and "
    "walked down the causeway without looking back. Today a small electric lamp, no larger than a teacup, does "
    "the work of the old burner, and a computer in an office far inland checks that it is still turning. Visitors "
    "climb the stairs in summer to look at the lens, which is kept polished by volunteers, and to read the "
    "logbooks in the keeper's room, where every entry records the weather, the ships that passed, and the hour "
    "the lamp was lit. Some of the entries are only a line long; others fill a page with the details of a rescue, "
    "a broken window, or a bird that flew into the glass and had to be nursed back to health in a box by the stove. "
    "Reading them, one has the sense of a life measured in small, exact tasks, repeated without complaint."
)
LENGTHS = [3, 5, 8, 12, 15, 16, 17, 24, 31, 33, 47, 64, 80, 110, 160, 300]
MAX_NEW = 8
WAVES = [(0, 6), (3, 11), (5, 16)]  # (steps run before, requests added so far): three arrival waves


@pytest.fixture(scope="module")
def cases(smollm2):
    """(model, prompts, each prompt's greedy tokens from generate alone)."""
    model, tok = smollm2
    ids = tok.encode(PASSAGE)
    assert len(ids) >= 330
    prompts = [ids[(7 * i) % 30 : (7 * i) % 30 + n] for i, n in enumerate(LENGTHS)]
    params = SamplingParams(max_new_tokens=MAX_NEW)
    alone = [[s.token_id for s in generate(model, p, params)] for p in prompts]
    return model, prompts, params, alone


def run_in_waves(engine, prompts, params):
    """Add requests in waves between steps, then step until all finish. Returns the request ids."""
    ids, steps = [], 0
    for steps_before, n_added in WAVES:
        while steps < steps_before:
            engine.step()
            steps += 1
        ids += [engine.add_request(p, params) for p in prompts[len(ids) : n_added]]
    while engine.has_unfinished_requests():
        engine.step()
    return ids


def top2_gap(model, prompt, tokens, i) -> float:
    """The reference's gap between its two largest logits before token i (a near-tie if tiny)."""
    cache = KVCache.for_model(model, max_seq_len=len(prompt) + i)
    top2 = prefill(model, prompt + tokens[:i], cache)[0].topk(2).values
    return (top2[0] - top2[1]).item()


# 36 or 24 blocks of 16 (576, 384 positions) for ~1,050: running requests run out of blocks and are preempted.
# (The tiny-model logits test runs each knob without preemption too.)
@pytest.mark.parametrize("knobs", [
    dict(num_blocks=36, max_num_batched_tokens=96),  # chunked prefill: the 300-token prompt in 4 steps
    dict(num_blocks=24, max_num_batched_tokens=320, enable_chunked_prefill=False),
], ids=["chunked-prefill", "whole-prompts"])
def test_batched_greedy_tokens_equal_generate_alone(cases, knobs):
    model, prompts, params, alone = cases
    engine = LLMEngine(model, block_size=16, **knobs)
    ids = run_in_waves(engine, prompts, params)
    for rid, prompt, expected in zip(ids, prompts, alone):
        got = engine.requests[rid].output_ids
        if got != expected:
            i = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            gap = top2_gap(model, prompt, expected, i)
            pytest.fail(f"request {rid} ({len(prompt)} prompt tokens) differs at output token {i}: "
                        f"engine {got}, alone {expected}; the reference's top-2 logit gap there is {gap:.2e}")
    waves_mixed = any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.steps)
    assert waves_mixed, "no step mixed a prefill with decodes: the arrivals did not overlap"
    preempted = [r for r in engine.requests.values() if r.num_preemptions]
    assert preempted and any(s.preempted for s in engine.steps)
    if not knobs.get("enable_chunked_prefill", True):  # each prompt prefilled whole, in its first step
        first = {}
        for step in engine.steps:
            for rid, p, _ in step.scheduled:
                first.setdefault(rid, p)
        assert first == {rid: len(prompt) for rid, prompt in zip(ids, prompts)}
    assert all(b.ref_count == 0 for b in engine.cache.allocator.blocks)
