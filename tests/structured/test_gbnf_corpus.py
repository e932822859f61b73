"""GBNF grammars (llama.cpp's format) through minillm.structured: llama.cpp's own grammars/*.gbnf
each compile and constrain generation on the random-weight chat model, or are refused with a
ValueError naming the construct (none of the pinned corpus is, today: REFUSED is empty)."""

import json
import re

import pytest
from llama_cpp_grammars import NAMES, VERSION, llama_cpp_grammars

import minillm
from minillm import SamplingParams

pytest.importorskip("llguidance")

from minillm.structured import Grammar  # noqa: E402

REFUSED: dict[str, str] = {}  # file name -> a fragment of the ValueError naming what is not supported
MAX_NEW_TOKENS = 24
# Oracles independent of llguidance (Python's re), read off the .gbnf files: the text so far is a prefix of a match
EN = r"""[a-zA-Z0-9!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"""
JP = "[ぁ-ゟァ-ヿ、-〾一-鿿]"
LINE = "[^\r\n\x0b\x0c\x85\u2028\u2029]"
MOVE = r"(([a-h]x)?[a-h][1-8](=[NBKQR])?|[NBKQR][a-h]?[1-8]?x?[a-h][1-8]|O-O(-O)?)[+#]?"
PREFIX_OK = {
    "english.gbnf": lambda text: re.fullmatch(f"({EN}+([ \t\n]{EN}+)*[ \t\n]?)?", text),
    "japanese.gbnf": lambda text: re.fullmatch(f"({JP}+([ \t\n]{JP}+)*[ \t\n]?)?", text),
    "list.gbnf": lambda text: re.fullmatch(f"(- {LINE}+\n)*(-( {LINE}*)?)?", text),
    "chess.gbnf": lambda text: "1. ".startswith(text) or text.startswith("1. ") and all(  # each whole line
        re.fullmatch(rf"[1-9][0-9]?\. {MOVE} {MOVE}", line) for line in text.split("\n")[:-1]),
}


@pytest.fixture(scope="module")
def corpus():
    return llama_cpp_grammars()


def test_the_corpus_is_the_pinned_one(corpus):
    assert tuple(corpus) == NAMES, f"llama-cpp-python=={VERSION}'s grammars changed: {sorted(corpus)}"
    assert all("::=" in text and "root" in text for text in corpus.values())


@pytest.mark.parametrize("name", NAMES)
def test_each_grammar_compiles_and_constrains_or_is_refused(corpus, tiny_chat, name):
    model, tokenizer = tiny_chat
    build = lambda: Grammar.lark(corpus[name], tokenizer, vocab_size=model.config.vocab_size,  # noqa: E731
                                 eos_token_ids=tokenizer.eos_token_ids)
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            build()
        return
    grammar = build()
    first = grammar.matcher().allowed()
    assert 0 < int(first.sum()) < model.config.vocab_size  # the mask bites: some tokens are ruled out
    for seed in (0, 1):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=MAX_NEW_TOKENS, allowed_tokens=grammar)
        steps = list(minillm.generate(model, [1, 2, 3], params, tokenizer=tokenizer))
        ids = [s.token_id for s in steps if s.finish_reason != "eos"]
        replay = grammar.matcher()  # the output so far is, after every token, a prefix the grammar takes
        for position, token_id in enumerate(ids):
            assert replay.allowed()[token_id], (name, position, tokenizer.decode(ids[:position + 1]))
            replay.accept(token_id)
        text = tokenizer.decode(ids)
        if name in PREFIX_OK:  # (a multi-byte character the last token left unfinished decodes as U+FFFD)
            assert PREFIX_OK[name](text.rstrip("\ufffd")), (name, text)
        if steps[-1].finish_reason == "eos":  # ended: a whole match
            assert replay.is_complete, (name, text)
            if name in ("json.gbnf", "json_arr.gbnf"):  # an oracle of its own: Python's JSON parser
                value = json.loads(text)
                assert name == "json.gbnf" and isinstance(value, dict) or isinstance(value, list), text
        print(f"{name} seed {seed}: {text!r} ({steps[-1].finish_reason})")
