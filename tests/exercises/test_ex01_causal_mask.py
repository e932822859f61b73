"""Exercise 1: the causal mask, square for a prompt, rectangular after a KV cache."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.registry import EXERCISES, reference

pytestmark = pytest.mark.ex01
LESSON = "lessons/02-prefill-and-decode.md#the-causal-mask"
REF = reference(EXERCISES["ex01"])


def mask(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row.split()] for row in rows])


def test_prompt_mask_is_lower_triangular(impl):
    c = Case("causal_mask(4, 4)", "a prompt of 4 tokens, empty cache", shapes="[n_queries, n_keys] = [4, 4], bool",
             hint="query i sees keys 0..i: itself and the tokens before it, never a later one", lesson=LESSON)
    c.equal(c.call(impl.causal_mask, 4, 4), mask(["1 0 0 0", "1 1 0 0", "1 1 1 0", "1 1 1 1"]))


def test_queries_after_a_cache_see_every_cached_key(impl):
    c = Case("causal_mask(2, 5)", "2 new tokens prefilled after 3 cached ones (keys 0..4, queries at positions 3, 4)",
             shapes="[n_queries, n_keys] = [2, 5], bool",
             hint="the queries are the LAST n_queries positions: query i sits at position n_keys - n_queries + i "
                  "and sees keys 0..that position (a square tril() hides cached keys)", lesson=LESSON)
    c.equal(c.call(impl.causal_mask, 2, 5), mask(["1 1 1 1 0", "1 1 1 1 1"]))


def test_one_decode_query_sees_every_key(impl):
    c = Case("causal_mask(1, 6)", "a decode step: 1 new token after 5 cached ones", shapes="[1, 6], bool",
             hint="the newest token is the last position: it sees all keys, itself included", lesson=LESSON)
    c.equal(c.call(impl.causal_mask, 1, 6), torch.ones(1, 6, dtype=torch.bool))


def test_mask_is_made_on_the_given_device(impl):
    c = Case("causal_mask(3, 3, device=torch.device('cpu'))", "the mask is built where the scores are (a GPU "
             "in real use)", shapes="[3, 3], bool", lesson=LESSON,
             hint="pass device= to the tensor you create: torch.ones(..., dtype=torch.bool, device=device)")
    got = c.call(impl.causal_mask, 3, 3, device=torch.device("cpu"))
    c.equal(got, mask(["1 0 0", "1 1 0", "1 1 1"]))


# Windows that tell the window's mistakes apart where a tiny input cannot (causal_mask(1, 2, window=1):
# a window ignored and a window one key too wide both answer "1 1"): 6 keys, bands of 2 and 3.
WINDOWS = [lambda: ((4, 6), {"window": 2}), lambda: ((6, 6), {"window": 3})]


@given(data=st.data())
@CHECKS
def test_agrees_with_the_reference_on_every_size_and_window(impl, data):
    n_keys = data.draw(st.integers(0, 40), label="n_keys")
    n_queries = data.draw(st.integers(0, n_keys), label="n_queries")
    window = data.draw(st.none() | st.integers(1, n_keys + 2), label="window")
    agree(impl.causal_mask, REF.causal_mask, lambda: ((n_queries, n_keys), {"window": window}),
          what="causal_mask", exercise="ex01", lesson=LESSON, tell_apart=WINDOWS,
          hint="query i sits at position n_keys - n_queries + i and sees keys j with position - window < j <= "
               "position (no lower bound without a window); sizes 0 and 1 are prompts too")
