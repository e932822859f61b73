"""The sampling hook for constrained decoding and logit_bias (minillm/sampling.py), with no grammar
library: a masked token is never sampled, whatever the knobs; logit_bias is OpenAI's."""

import pytest
import torch
from constraints import Rule
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import SamplingParams
from minillm.sampling import AllowedTokens, TokenMatcher, sample_constrained

VOCAB = 64


def test_the_protocols_describe_the_hook():
    assert isinstance(Rule(), AllowedTokens) and isinstance(Rule().matcher(), TokenMatcher)
    with pytest.raises(ValueError, match="allowed_tokens must be None or an object with a matcher"):
        SamplingParams(allowed_tokens=[1, 2])


params_st = st.builds(
    SamplingParams, temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]), top_k=st.sampled_from([0, 1, 3, 40]),
    top_p=st.sampled_from([1.0, 0.9, 0.2]), min_p=st.sampled_from([0.0, 0.1]),
    repetition_penalty=st.sampled_from([1.0, 1.5]), presence_penalty=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 2**32), logit_bias=st.sampled_from([None, {3: 100.0}, {7: -100.0, 8: 50.0}]))


@settings(max_examples=300, deadline=None)
@given(params=params_st, seed=st.integers(0, 2**32), density=st.sampled_from([0.01, 0.1, 0.5, 0.99]))
def test_a_masked_token_is_never_sampled(params, seed, density):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, VOCAB, generator=g) * 5
    allowed = torch.rand(VOCAB, generator=g) < density
    allowed[torch.randint(VOCAB, (1,), generator=g)] = True  # at least one
    output = torch.randint(VOCAB, (1, 4), generator=g)
    token, logprob = sample_constrained(logits, params, params.make_generator("cpu"), output, output, allowed[None])
    assert allowed[token.item()]
    # the logprob stays the model's own (the raw logits'), as vLLM reports it
    assert logprob.item() == pytest.approx(torch.log_softmax(logits, -1)[0, token.item()].item(), abs=1e-5)


def test_a_row_with_nothing_allowed_is_an_error():
    with pytest.raises(ValueError, match="allows no token"):
        sample_constrained(torch.randn(1, VOCAB), SamplingParams(), allowed=torch.zeros(1, VOCAB, dtype=torch.bool))


def test_logit_bias_bans_and_forces_as_openai_defines_it():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    best = logits.argmax().item()
    banned, _ = sample_constrained(logits, SamplingParams(logit_bias={best: -100}))
    assert banned.item() != best
    assert banned.item() == logits[0].clone().index_fill_(0, torch.tensor([best]), -1e9).argmax().item()
    forced = SamplingParams(temperature=1.0, seed=1, logit_bias={5: 100})
    assert {sample_constrained(logits, forced, torch.Generator().manual_seed(s))[0].item() for s in range(20)} == {5}
    nudged, _ = sample_constrained(logits, SamplingParams(logit_bias={7: 0.5}))  # added to the logit, not a probability
    assert nudged.item() == (logits[0] + torch.nn.functional.one_hot(torch.tensor(7), VOCAB) * 0.5).argmax().item()


@pytest.mark.parametrize("bias, message", [({1: 101}, r"logit_bias\[1\] must be a number in \[-100, 100\]"),
                                           ({-1: 5}, "logit_bias token id must be an integer >= 0"),
                                           ({"3": 5}, "logit_bias token id must be an integer"),
                                           ([1, 2], "logit_bias must be a dict")])
def test_bad_logit_bias_is_refused(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_generate_asks_the_matcher_each_step_and_the_trace_counts_the_allowed(tiny_model_cpu):
    from minillm import generate
    from minillm.trace import Trace

    model = tiny_model_cpu
    rule = Rule(model.config.vocab_size, modulus=7)
    trace = Trace()
    steps = list(generate(model, [1, 2, 3], SamplingParams(temperature=1.0, seed=3, max_new_tokens=12,
                                                             allowed_tokens=rule), eos_token_ids=(), trace=trace))
    tokens = [s.token_id for s in steps]
    assert rule.matchers[0].accepted == tokens and len(tokens) == 12  # RuleMatcher.accept checks each is allowed
    counts = [e["allowed_tokens"] for e in trace.events if e["kind"] in ("prefill", "decode") and "next_token_id" in e]
    expected = [int(((torch.arange(model.config.vocab_size) + sum(tokens[:i])) % 7 == 0).sum()) for i in range(12)]
    assert counts == expected
    with pytest.raises(ValueError, match="logit_bias names token"):
        next(generate(model, [1, 2], SamplingParams(logit_bias={model.config.vocab_size: 1.0})))


@pytest.fixture(scope="module")
def tiny_model_cpu(tmp_path_factory):
    from tiny_models import CONFIGS, build_hf, save_hf

    import minillm

    family, kwargs = CONFIGS["llama_gqa"]
    return minillm.load_model(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("allowed")), device="cpu")
