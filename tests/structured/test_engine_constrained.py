"""The engine's constrained decoding and logit_bias (tiny random model, no grammar library): each
request's matcher is asked before every token and told every token it keeps, through batching,
preemption (the K/V recomputed, the matcher kept) and parallel sampling (n > 1: one matcher each)."""

import pytest
import torch
from constraints import Rule

from minillm import LLMEngine, SamplingParams, generate


def rule_holds(tokens, vocab, modulus):
    return all((t + sum(tokens[:i])) % modulus == 0 for i, t in enumerate(tokens))


def test_matchers_survive_batching_and_preemption(tiny_model):
    model = tiny_model("llama_gqa")
    vocab = model.config.vocab_size
    prompts = [list(range(1 + i, 30 + 3 * i)) for i in range(4)]
    params = [SamplingParams(temperature=t, seed=s, max_new_tokens=14, allowed_tokens=Rule(vocab, 3 + s))
              for t, s in ((0.0, 0), (1.0, 1), (0.7, 2), (1.0, 3))]
    # 8 blocks of 4 positions for 4 requests of ~45 positions: they preempt one another
    engine = LLMEngine(model, eos_token_ids=(), num_blocks=20, block_size=4, max_num_batched_tokens=32)
    outs = engine.generate(prompts, params)
    assert sum(r.num_preemptions for r in engine.requests.values()) > 0
    for prompt, p, out in zip(prompts, params, outs):
        assert rule_holds(out.token_ids, vocab, p.allowed_tokens.modulus)
        assert p.allowed_tokens.matchers[0].accepted == out.token_ids  # told each kept token once
        alone = [s.token_id for s in generate(model, prompt, SamplingParams(
            temperature=p.temperature, seed=p.seed, max_new_tokens=14, allowed_tokens=Rule(vocab, p.allowed_tokens.modulus)),
            eos_token_ids=())]
        assert out.token_ids == alone  # the same tokens as generate alone: the mask at each step was right


def test_each_parallel_sequence_has_its_own_matcher(tiny_model):
    model = tiny_model("llama_gqa")
    rule = Rule(model.config.vocab_size, 4)
    engine = LLMEngine(model, eos_token_ids=(), num_blocks=64, block_size=4)
    rid = engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=1.0, seed=7, max_new_tokens=8,
                                                             allowed_tokens=rule), n=3)
    while engine.has_unfinished_requests():
        engine.step()
    sequences = engine.sequences(rid)
    assert len(sequences) == 3 and len(rule.matchers) == 3
    assert sorted(map(tuple, (m.accepted for m in rule.matchers))) == sorted(tuple(s.output_ids) for s in sequences)
    assert all(rule_holds(s.output_ids, model.config.vocab_size, 4) for s in sequences)


def test_logit_bias_in_the_engine(tiny_model):
    model = tiny_model("llama_gqa")
    prompt = [3, 1, 4, 1, 5]
    greedy = [s.token_id for s in generate(model, prompt, SamplingParams(max_new_tokens=6), eos_token_ids=())]
    engine = LLMEngine(model, eos_token_ids=(), num_blocks=64, block_size=4)
    banned, forced, plain = engine.generate([prompt] * 3, [
        SamplingParams(max_new_tokens=6, logit_bias={greedy[0]: -100}),
        SamplingParams(max_new_tokens=6, temperature=1.0, seed=0, logit_bias={42: 100}),
        SamplingParams(max_new_tokens=6)])
    assert plain.token_ids == greedy
    assert greedy[0] not in banned.token_ids and banned.token_ids[0] != greedy[0]
    assert forced.token_ids == [42] * 6
    with pytest.raises(ValueError, match="logit_bias names token"):
        engine.add_request(prompt, SamplingParams(logit_bias={model.config.vocab_size: -100}))
    assert torch.is_tensor(engine.requests[engine.add_request(prompt, SamplingParams(
        max_new_tokens=1, allowed_tokens=Rule(model.config.vocab_size)))].matcher.allowed())
