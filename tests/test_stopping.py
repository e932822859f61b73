"""minillm/stopping.py: the finish reasons, stop strings (held back while they could still start, cut
out when found) and the text stream, then generate()'s checks of its arguments. Oracles: hand cases
(a four-word tokenizer), str.find on the whole text, tokenizer.decode of all the ids."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import SamplingParams, generate, load_model, load_tokenizer
from minillm.stopping import StopStringMatcher, TextStream, check_stop, finish_reason


# -- the finish reasons: the table of minillm/stopping.py, case by case ------------------------------

EOS = {0}


@pytest.mark.parametrize("token, n, params, cache_full, expected", [
    (5, 1, SamplingParams(max_new_tokens=4), False, (None, None)),
    (0, 1, SamplingParams(max_new_tokens=4), False, ("eos", None)),
    (0, 1, SamplingParams(max_new_tokens=4, ignore_eos=True), False, (None, None)),
    (7, 1, SamplingParams(max_new_tokens=4, stop_token_ids=[7]), False, ("stop", 7)),
    (0, 1, SamplingParams(max_new_tokens=4, stop_token_ids=[0]), False, ("eos", None)),  # eos first
    (0, 1, SamplingParams(max_new_tokens=4, stop_token_ids=[0], ignore_eos=True), False, ("stop", 0)),
    (5, 4, SamplingParams(max_new_tokens=4), False, ("length", None)),
    (5, 4, SamplingParams(max_new_tokens=4), True, ("length", None)),  # length before cache_full
    (5, 3, SamplingParams(max_new_tokens=4), True, ("cache_full", None)),
    (7, 4, SamplingParams(max_new_tokens=4, stop_token_ids=[7]), True, ("stop", 7)),
])
def test_finish_reason_is_the_first_rule_that_applies(token, n, params, cache_full, expected):
    assert finish_reason(token, n, EOS, params, cache_full) == expected
    assert check_stop(token, n, EOS, params, cache_full, None) == (*expected, None)  # no text: no piece


class WordTokenizer:
    """A four-word vocabulary whose text is its tokens joined: what StreamDecoder needs, nothing more."""

    vocab = ["Paris", ".", "\n", "User:"]
    special_ids = frozenset()
    byte_fallback_ids = frozenset()

    def check_ids(self, ids):
        return list(ids)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids)


def _stream(tokens, params, eos=frozenset()):
    """check_stop token by token until a reason: [(reason, stop_reason, piece)], and the stream."""
    text, out = TextStream(WordTokenizer(), params.stop), []
    for n, token in enumerate(tokens, 1):
        out.append(check_stop(token, n, eos, params, False, text))
        if out[-1][0]:
            break
    return out, text


def test_a_stop_string_over_three_tokens_ends_with_stop_and_is_never_shown():
    out, text = _stream([0, 1, 2, 2, 3, 0], SamplingParams(max_new_tokens=10, stop="\n\nUser:"))
    assert out == [(None, None, "Paris"), (None, None, "."), (None, None, ""), (None, None, ""),
                   ("stop", "\n\nUser:", "")]
    assert text.text == "Paris." and text.matched == "\n\nUser:"


def test_the_last_token_releases_the_held_text():
    out, text = _stream([0, 1, 2], SamplingParams(max_new_tokens=3, stop="\n\nUser:"))
    assert out[-1] == ("length", None, "\n") and text.text == "Paris.\n"  # "\n" was held, length ends it


def test_a_stop_string_wins_over_the_token_rule_of_the_same_token():
    out, text = _stream([0, 1], SamplingParams(max_new_tokens=10, stop="."), eos={1})
    assert out[-1] == ("stop", ".", "") and text.text == "Paris"  # "." is an EOS id and the stop string


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


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet="ab ", max_size=30), stops=st.lists(st.text(alphabet="ab ", min_size=1, max_size=8),
                                                                  min_size=1, max_size=3))
def test_the_held_back_end_is_the_longest_proper_start_of_a_stop_string(text, stops):
    """Against the definition, prefix by prefix: the longest end of the text that is a proper start of one."""
    by_definition = max((n for s in stops for n in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:n])),
                        default=0)
    assert StopStringMatcher(tuple(stops))._longest_partial_match(text) == by_definition
