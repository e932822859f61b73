"""What the server asks of the engine beyond tokens: logprobs with the top k (chat's logprobs) and
ignore_eos (benchmarks). Oracles: generate's logprob, and log_softmax of prefill's own logits."""

import pytest
import torch

from minillm import KVCache, LLMEngine, SamplingParams, generate, prefill

PROMPT = [3, 17, 42, 5, 9]


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama_gqa")  # vocab 128


def run(engine, prompt, params, **kwargs):
    request_id = engine.add_request(prompt, params, **kwargs)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs[-1]


def test_logprobs_and_top_k_match_generate_and_prefill(model):
    engine = LLMEngine(model, num_blocks=32, block_size=4, eos_token_ids=())
    out = run(engine, PROMPT, SamplingParams(max_new_tokens=5), logprobs=3)
    steps = list(generate(model, PROMPT, SamplingParams(max_new_tokens=5), eos_token_ids=()))
    assert out.token_ids == [s.token_id for s in steps] and len(out.logprobs) == 5
    for (logprob, top), step in zip(out.logprobs, steps):
        assert logprob == pytest.approx(step.logprob, abs=1e-4)
        assert top[0][0] == step.token_id and top[0][1] == pytest.approx(logprob, abs=1e-6)  # greedy: the top one
    # the first token's top 3, from the prompt's logits computed by prefill alone
    logits = prefill(model, PROMPT, KVCache.for_model(model, max_seq_len=16))[0]
    expected = torch.log_softmax(logits.float(), -1).topk(3)
    assert [i for i, _ in out.logprobs[0][1]] == expected.indices.tolist()
    assert [lp for _, lp in out.logprobs[0][1]] == pytest.approx(expected.values.tolist(), abs=1e-4)
    assert run(engine, PROMPT, SamplingParams(max_new_tokens=2)).logprobs is None  # not asked: not kept


@pytest.mark.parametrize("logprobs", [-1, True, "3", 1.5])
def test_bad_logprobs_are_value_errors(model, logprobs):
    engine = LLMEngine(model, num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="logprobs must be None or a number of top tokens"):
        engine.add_request(PROMPT, SamplingParams(max_new_tokens=2), logprobs=logprobs)
    assert not engine.requests


def test_ignore_eos_runs_to_max_tokens_in_engine_and_generate(model):
    first = next(generate(model, PROMPT, SamplingParams(max_new_tokens=1))).token_id  # make it the EOS
    engine = LLMEngine(model, num_blocks=32, block_size=4, eos_token_ids=[first])
    stopped = run(engine, PROMPT, SamplingParams(max_new_tokens=6))
    assert (stopped.finish_reason, len(stopped.token_ids)) == ("eos", 1)
    ignored = run(engine, PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
    alone = list(generate(model, PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True), eos_token_ids=[first]))
    assert ignored.token_ids == [s.token_id for s in alone] and len(alone) == 6
    assert ignored.finish_reason == alone[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="ignore_eos must be True or False"):
        SamplingParams(ignore_eos="yes")
