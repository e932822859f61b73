"""No request can harm another: a part of one request that fails during a step (its constraint's
matcher, its logits row, its stop strings) ends that request alone with finish_reason "error", and
every other request gets exactly the tokens it gets in a run without it (the oracle: the same
engine, the same requests, the hostile one left out)."""

import copy

import pytest
import torch
from constraints import FailsAfter, Rule

from minillm import LLMEngine, SamplingParams

VICTIMS = [  # greedy, seeded sampling, sampling with penalties and a bias, a constraint that works
    ([5, 6, 7, 8, 9, 10, 11], lambda vocab: SamplingParams(max_new_tokens=12, ignore_eos=True)),
    ([40, 41, 42], lambda vocab: SamplingParams(temperature=1.0, seed=3, max_new_tokens=12, ignore_eos=True)),
    ([7] * 20, lambda vocab: SamplingParams(temperature=0.8, seed=5, top_k=20, repetition_penalty=1.3,
                                            logit_bias={9: 5.0}, max_new_tokens=12, ignore_eos=True)),
    ([1, 2, 3], lambda vocab: SamplingParams(temperature=1.0, seed=9, max_new_tokens=12, ignore_eos=True,
                                             allowed_tokens=Rule(vocab, 3))),
]


def run(model, requests, **engine_kwargs):
    """Every request to completion in one engine, added together: {index: final output}."""
    engine = LLMEngine(model, eos_token_ids=(), num_blocks=64, block_size=4, **engine_kwargs)
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[ids.index(out.request_id)] = out
    return [final[i] for i in range(len(ids))]


def victims(vocab):
    return [(prompt, make(vocab)) for prompt, make in VICTIMS]


def fresh(requests):
    """The same requests with new constraints and generators (a matcher keeps state)."""
    return [(p, copy.deepcopy(params)) for p, params in requests]


@pytest.mark.parametrize("where, after", [("allowed", 0), ("allowed", 4), ("accept", 0), ("accept", 6)])
def test_a_failing_constraint_ends_its_request_alone(tiny_model, where, after):
    model = tiny_model("llama_gqa")
    vocab = model.config.vocab_size
    alone = run(model, fresh(victims(vocab)))
    hostile = ([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=12, ignore_eos=True,
                                               allowed_tokens=FailsAfter(after, vocab, where)))
    *together, failed = run(model, fresh(victims(vocab)) + [hostile])
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.finish_reason for o in together] == ["length"] * len(VICTIMS)
    assert failed.finish_reason == "error" and failed.stop_reason == "allowed_tokens"
    assert len(failed.token_ids) == after  # the token it could not take is not kept
    assert "lexer fuel exhausted" in failed.message and "\n" not in failed.message
    assert f"after {after} output tokens" in failed.message or after == 0


def test_a_nan_logits_row_ends_its_request_alone(tiny_model):
    """A token whose embedding is NaN poisons only the rows of the request that holds it."""
    model = copy.deepcopy(tiny_model("llama_gqa"))
    poison = model.config.vocab_size - 1
    with torch.no_grad():
        model.embed.weight[poison] = float("nan")
    vocab = model.config.vocab_size
    alone = run(model, fresh(victims(vocab)))
    *together, failed = run(model, fresh(victims(vocab)) + [([2, poison, 4], SamplingParams(max_new_tokens=4))])
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert failed.finish_reason == "error" and failed.stop_reason == "logits" and failed.token_ids == []
    assert "NaN" in failed.message


def test_a_failed_request_frees_its_blocks_and_the_pool_serves_on(tiny_model):
    model = tiny_model("llama_gqa")
    vocab = model.config.vocab_size
    engine = LLMEngine(model, eos_token_ids=(), num_blocks=16, block_size=4, enable_prefix_caching=False)
    engine.add_request(list(range(10, 30)), SamplingParams(max_new_tokens=8, allowed_tokens=FailsAfter(2, vocab)))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cache.allocator.num_free_blocks == 16
    (out,) = engine.generate([list(range(10, 30))], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_parallel_sequences_of_a_failing_request_end_and_others_do_not(tiny_model):
    model = tiny_model("llama_gqa")
    vocab = model.config.vocab_size
    engine = LLMEngine(model, eos_token_ids=(), num_blocks=64, block_size=4)
    bad = engine.add_request([5, 6, 7], SamplingParams(temperature=1.0, seed=1, max_new_tokens=6,
                                                       allowed_tokens=FailsAfter(3, vocab)), n=3)
    good = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.finish_reason for s in engine.sequences(bad)] == ["error"] * 3
    assert [len(s.output_ids) for s in engine.sequences(bad)] == [3] * 3
    assert engine.requests[good].finish_reason == "length"


def test_a_constraint_that_cannot_start_is_refused_at_admission(tiny_model):
    class Broken:
        def matcher(self):
            raise RuntimeError("grammar too large")

    engine = LLMEngine(tiny_model("llama_gqa"), num_blocks=16)
    with pytest.raises(ValueError, match="the constraint .allowed_tokens. cannot start: RuntimeError: grammar too large"):
        engine.add_request([1, 2, 3], SamplingParams(allowed_tokens=Broken()))
    assert not engine.has_unfinished_requests()


def test_a_failure_no_request_owns_still_raises(tiny_model):
    """The forward pass failing is no request's: step raises, as before (the server then fails the batch)."""
    model = copy.deepcopy(tiny_model("llama_gqa"))
    engine = LLMEngine(model, num_blocks=16)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    model.blocks[0].attn.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
