"""Stop strings (held back while they could still start, cut out when found) and generate()'s
checks of its arguments. Oracle: str.find on the whole text; tokenizer.decode of all the ids."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import SamplingParams, generate, load_model, load_tokenizer
from minillm.stop_strings import StopStringMatcher


def _run(pieces, stop):
    matcher = StopStringMatcher(stop)
    out = [matcher.push(p) for p in pieces]
    if matcher.matched is None:
        out.append(matcher.flush())
    return out, matcher.matched


def test_a_stop_string_split_across_pieces_is_held_then_dropped():
    out, matched = _run(["Paris.", "\n", "\nUser", ":", " more"], ["\n\nUser:"])
    assert out == ["Paris.", "", "", "", ""] and matched == "\n\nUser:"  # nothing after the match either


def test_held_text_is_released_when_it_stops_matching():
    out, matched = _run(["a", "b", "x", "c", "a"], ["abc"])
    assert out == ["", "", "abx", "c", "", "a"] and matched is None  # the last "a" comes out at the end (flush)


def test_earliest_stop_string_wins_and_text_after_it_is_dropped():
    out, matched = _run(["one. two! three"], ["!", "."])
    assert out == ["one"] and matched == "."


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab.", max_size=20), cuts=st.lists(st.integers(0, 20), max_size=6),
       stop=st.lists(st.text("ab.", min_size=1, max_size=4), min_size=1, max_size=3))
def test_streamed_text_is_the_text_before_the_first_stop_string(text, cuts, stop):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[i:j] for i, j in zip(bounds, bounds[1:])]
    out, matched = _run(pieces, stop)
    # Generation ends at the first piece after which the text holds a stop string (later pieces are
    # never generated); the answer is cut at the earliest stop string in the text up to there.
    seen = next((text[:end] for end in bounds[1:] if any(s in text[:end] for s in stop)), text)
    found = [seen.find(s) for s in stop if s in seen]
    assert "".join(out) == (seen[: min(found)] if found else text)
    assert (matched is not None) == bool(found)
    for n in range(1, len(out) + 1):  # no prefix of what was shown ever holds a stop string
        assert not any(s in "".join(out[:n]) for s in stop)


# -- generate() with a tokenizer ------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    return load_model(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("llama")), device="cpu")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)  # the tiny model's 128 ids are SmolLM2's first 128 tokens


PROMPT = [40, 50, 60, 70]


def test_step_texts_join_into_the_decoded_answer(model, tokenizer):
    steps = list(generate(model, PROMPT, SamplingParams(max_new_tokens=12), tokenizer=tokenizer, eos_token_ids=()))
    assert "".join(s.text for s in steps) == tokenizer.decode([s.token_id for s in steps])
    assert all(s.text is None for s in generate(model, PROMPT, SamplingParams(max_new_tokens=3), eos_token_ids=()))


def test_generate_stops_at_a_stop_string_across_tokens_and_never_shows_it(model, tokenizer):
    steps = list(generate(model, PROMPT, SamplingParams(max_new_tokens=12), tokenizer=tokenizer, eos_token_ids=()))
    texts = [tokenizer.decode([s.token_id]) for s in steps]
    full = "".join(texts)
    # two characters across a token boundary, found first there: the last of one token, the first of the next
    ends = list(itertools.accumulate(len(t) for t in texts))
    stop = next(full[b - 1 : b + 1] for b in ends[:-1] if 0 < b < len(full) and full.find(full[b - 1 : b + 1]) == b - 1)
    stopped = list(generate(model, PROMPT, SamplingParams(max_new_tokens=12, stop=[stop]), tokenizer=tokenizer,
                            eos_token_ids=()))
    assert "".join(s.text for s in stopped) == full[: full.find(stop)]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop
    assert [s.token_id for s in stopped] == [s.token_id for s in steps[: len(stopped)]]
    shown = ""
    for s in stopped:
        shown += s.text
        assert stop not in shown


def test_stop_token_id_is_the_stop_reason(model):
    first = next(generate(model, PROMPT, SamplingParams(max_new_tokens=5), eos_token_ids=()))
    steps = list(generate(model, PROMPT, SamplingParams(max_new_tokens=5, stop_token_ids=[first.token_id]),
                          eos_token_ids=()))
    assert len(steps) == 1 and (steps[0].finish_reason, steps[0].stop_reason) == ("stop", first.token_id)


def test_penalties_reach_generate(model):
    greedy = [s.token_id for s in generate(model, PROMPT, SamplingParams(max_new_tokens=12), eos_token_ids=())]
    assert len(set(greedy)) < len(greedy)  # the tiny model repeats itself
    params = SamplingParams(max_new_tokens=12, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    penalized = [s.token_id for s in generate(model, PROMPT, params, eos_token_ids=())]
    assert penalized != greedy and len(set(penalized)) > len(set(greedy))


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ("hello", {}, r"takes token ids, not text; encode it first: generate\(model, tok.encode\(text\)\)"),
        ([[1, 2], [3, 4]], {}, r"runs one prompt, got a batch of shape \(2, 2\); for a batch call prefill and decode_step"),
        ([], {}, "prompt_ids is empty"),
        ([1.5, 2.0], {}, "prompt_ids must hold integer token ids"),
        ([[[1]]], {}, r"must be \[T\] or \[1, T\]"),
        (None, {}, "prompt_ids must be a list of token ids or an integer tensor, got None"),
        ([[1, 2], [3]], {}, "prompt_ids must be a list of token ids or an integer tensor"),
        ([1, 2], {"params": SamplingParams(stop="."),}, "pass tokenizer= to generate"),
        ([1, 2], {"params": {"temperature": 1.0}}, "params must be a SamplingParams"),
        ([1, 2], {"eos_token_ids": "."}, "eos_token_ids must be a token id or a list of them"),
    ],
)
def test_bad_generate_arguments_say_what_to_do(model, prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        next(generate(model, prompt, **kwargs))


def test_a_batch_of_one_and_an_int_eos_are_accepted(model):
    steps = list(generate(model, torch.tensor([PROMPT]), SamplingParams(max_new_tokens=3), eos_token_ids=127))
    assert [s.token_id for s in steps] == [s.token_id for s in generate(model, PROMPT, SamplingParams(max_new_tokens=3),
                                                                         eos_token_ids=[127])]


def test_trace_records_the_penalty_and_the_detokenized_text(model, tokenizer):
    from minillm import Trace

    trace = Trace()
    params = SamplingParams(max_new_tokens=4, repetition_penalty=1.5)
    steps = list(generate(model, PROMPT, params, tokenizer=tokenizer, eos_token_ids=(), trace=trace))
    assert trace.first("decode")["sampling"] == {"method": "greedy", "repetition_penalty": 1.5}
    detok = trace.first("detokenize")
    assert detok["n_tokens"] == 4 and detok["text"] == "".join(s.text for s in steps) and detok["time_ms"] >= 0
