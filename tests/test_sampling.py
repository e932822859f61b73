"""SamplingParams checks (types, vLLM spellings), penalties, min-p, the order of operations,
and sampling at numerical extremes. Oracles: hand-computed cases and transformers' processors."""

import math

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.sampling import SamplingParams, apply_penalties, filter_logits, sample

INF = float("inf")


# -- parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": "0.5"}, "temperature must be a finite number >= 0 .*got '0.5'"),
        ({"temperature": True}, "temperature must be a finite number"),
        ({"top_k": 1.5}, "top_k must be an integer >= 0 .*got 1.5"),
        ({"top_p": "1"}, r"top_p must be in \(0, 1\]"),
        ({"stop_token_ids": "."}, r"stop_token_ids must be a list of token ids .*got '\.' \(for text, use stop=\['\.'\]\)"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids must be a list of token ids"),
        ({"stop": ""}, "stop must be a non-empty string or a list of them"),
        ({"stop": [".", 3]}, "stop must be a non-empty string or a list of them"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": INF}, "repetition_penalty must be a finite number > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 1"),
    ],
)
def test_bad_values_and_types_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_scalars_vllm_spellings_and_single_stop_string_are_accepted():
    params = SamplingParams(temperature=numpy.float32(0.5), top_k=numpy.int64(5), seed=numpy.int64(3),
                            stop_token_ids=numpy.array([7, 8]), stop="\n")
    assert (params.temperature, params.top_k, params.seed) == (0.5, 5, 3)
    assert type(params.top_k) is int and params.stop_token_ids == (7, 8) and params.stop == ("\n",)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()


def test_max_tokens_is_a_deprecated_alias_of_max_new_tokens():
    with pytest.warns(DeprecationWarning, match=r"max_tokens=\.\.\.\) is deprecated: write max_new_tokens=16") as caught:
        params = SamplingParams(max_tokens=16, temperature=0.5)  # vLLM's name
    assert params == SamplingParams(max_new_tokens=16, temperature=0.5)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="same knob"):
        SamplingParams(max_new_tokens=16, max_tokens=8)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-39, True), (9.9e-6, True), (1e-5, False)])
def test_temperatures_below_vllms_epsilon_are_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


# -- penalties -------------------------------------------------------------------------------


def test_repetition_penalty_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0]])
    # token 0 in the prompt, token 1 in the output, 4 in both; tokens 2 and 3 unseen
    got = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), torch.tensor([[0, 4]]),
                          torch.tensor([[1, 4, 4]]))
    assert got.tolist() == [[1.0, -2.0, 0.5, -3.0, 2.0]]


def test_presence_and_frequency_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # output: token 1 once, token 3 three times; token 0 only in the prompt: untouched
    got = apply_penalties(logits, params, torch.tensor([[0]]), torch.tensor([[3, 1, 3, 3]]))
    expected = [[2.0, -1.0 - 0.5 - 0.25, 0.5, 1.0 - 0.5 - 3 * 0.25]]
    assert torch.allclose(got, torch.tensor(expected))


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    prompt, output = torch.randint(0, 50, (3, 7)), torch.randint(0, 50, (3, 5))
    ours = apply_penalties(logits, SamplingParams(repetition_penalty=1.3), prompt, output)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.cat([prompt, output], dim=1), logits.clone())
    assert torch.equal(ours, theirs)


def test_penalties_change_greedy_and_keep_inf_and_overflow_finite():
    logits = torch.tensor([[3.0, 2.9, -INF, -3e38]])
    params = SamplingParams(repetition_penalty=2.0)
    tokens, logprobs = sample(logits, params, prompt_ids=[[0, 3]])
    assert tokens.tolist() == [1]  # 3.0 / 2 < 2.9: the penalty moved the argmax
    assert logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())  # the raw model's
    penalized = apply_penalties(logits, params, torch.tensor([[0, 2, 3]]), torch.zeros(1, 0, dtype=torch.long))
    assert penalized[0, 2] == -INF and penalized[0, 3] == torch.finfo(torch.float32).min


# -- min-p, order ----------------------------------------------------------------------------


def test_min_p_hand_computed():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])  # threshold 0.5 * 0.5 = 0.25: keeps 0.5 and 0.3
    kept = torch.isfinite(filter_logits(probs.log(), SamplingParams(temperature=1.0, min_p=0.5)))
    assert kept.tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9, 1.0])
def test_min_p_matches_transformers(min_p):
    from transformers import MinPLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(4, 100) * 3
    ours = filter_logits(logits, SamplingParams(temperature=1.0, min_p=min_p))
    theirs = MinPLogitsWarper(min_p)(None, logits.clone())
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))


def test_temperature_comes_before_top_p():
    # probs at T=1: softmax([2, 1, 0]) = 0.665, 0.245, 0.090; top_p 0.7 keeps 2 tokens.
    # At T=0.5 the top token alone has 0.867 >= 0.7: applied after temperature, top-p keeps 1.
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=0.5, top_p=0.7)))
    assert kept.tolist() == [[True, False, False]]


# -- extremes --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1e-38, 1e-39, 1e-5, 1e30, 1e300])
def test_extreme_temperatures_sample(dtype, temperature):
    logits = torch.tensor([[1.0, 5.0, -INF, 4.0], [3e38, -3e38, 0.0, 3e38]]).to(dtype)
    params = SamplingParams(temperature=temperature, seed=0)
    tokens, logprobs = sample(logits, params, params.make_generator("cpu"))
    assert torch.isfinite(logits.float()[[0, 1], tokens]).all() and torch.isfinite(logprobs).all()
    if temperature <= 1e-5:  # greedy, or as sharp as greedy
        assert tokens[0] == 1 and tokens[1] in (0, 3)


@pytest.mark.parametrize("bad", [[[0.0, float("nan")]], [[0.0, INF]], [[-INF, -INF]]])
def test_broken_logits_are_a_clear_error(bad):
    with pytest.raises(ValueError, match="logits must be finite or -inf"):
        sample(torch.tensor(bad), SamplingParams(temperature=1.0))


_VALUES = st.sampled_from([0.0, 1.0, -1.0, 1e-30, 30.0, -30.0, 1e30, -1e30, 3e38, -3e38, -INF])


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.lists(_VALUES, min_size=5, max_size=5), min_size=1, max_size=3),
    temperature=st.sampled_from([0.0, 1e-39, 1e-6, 1e-5, 0.1, 1.0, 7.0, 1e30, 1e300]),
    top_k=st.sampled_from([0, 1, 2, 5, 10]),
    top_p=st.sampled_from([1e-30, 0.1, 0.5, 0.999, 1.0]),
    min_p=st.sampled_from([0.0, 1e-30, 0.5, 1.0]),
    bfloat16=st.booleans(),
    seed=st.integers(0, 2**63 - 1),
)
def test_any_accepted_params_sample_a_possible_token(rows, temperature, top_k, top_p, min_p, bfloat16, seed):
    """Ties, -inf entries and magnitudes near float32's limit: a token is always drawn, it is
    never a -inf one, and settings that leave only the top token pick it (or a tie with it:
    exactly for greedy; for top_k 1, min_p 1 and a tiny top_p, among the float32 ties after temperature)."""
    rows = [r if any(math.isfinite(x) for x in r) else [0.0, *r[1:]] for r in rows]  # each row needs a finite logit
    logits = torch.tensor(rows).to(torch.bfloat16 if bfloat16 else torch.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    tokens, logprobs = sample(logits, params, params.make_generator("cpu"))
    chosen = logits.float().gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.isfinite(chosen).all() and torch.isfinite(logprobs).all()
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    tempered = shifted / min(temperature, 3e38)  # at 1e30, logits 1e-30 apart are tied in float32
    probs = torch.softmax(tempered, dim=-1)
    if params.greedy:
        assert torch.equal(chosen, logits.float().amax(dim=-1))
    elif top_k == 1:
        assert torch.equal(tempered.gather(-1, tokens[:, None]), tempered.amax(dim=-1, keepdim=True))
    elif min_p == 1.0 or top_p == 1e-30:
        assert torch.equal(probs.gather(-1, tokens[:, None]), probs.amax(dim=-1, keepdim=True))


@pytest.mark.parametrize("top_p", [1e-46, 1e-45, 1e-30])
def test_a_top_p_below_float32s_smallest_keeps_the_most_likely_token(top_p):
    """top_p rounds to 0 in float32: the mass before the first token (0) is already >= it, yet the most
    likely token stays (the docstring's rule), so sampling is the argmax, not a NaN distribution."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample(logits, SamplingParams(temperature=1.0, top_p=top_p), torch.Generator().manual_seed(1))
    assert tokens.tolist() == logits.argmax(-1).tolist()
