"""Exercise 7: decode_step, one new token at position cache.length."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS
from exercises.forward_kit import (agree_on_the_cache, draw_case, filled_cache, full_forward_last, ids_of,
                                   model_for, table)
from exercises.models import prompt, tiny_model
from exercises.registry import EXERCISES, reference
from minillm import KVCache
from minillm.errors import CacheFullError
from minillm.phases import prefill

pytestmark = pytest.mark.ex07
LESSON = "lessons/02-prefill-and-decode.md#decode"
HOW = ("the new token sits at position cache.length (a prompt of 5 -> position 5): positions = "
       "arange(cache.length, cache.length + 1); run embed (+ pos_embed), rope, every block with the cache, "
       "cache.advance(1), then lm_head(ln_final(x))[:, -1].float()")


def after_prefill(model, ids, max_seq_len=16):
    cache = KVCache.for_model(model, batch_size=ids.shape[0], max_seq_len=max_seq_len)
    prefill(model, ids, cache)
    return cache


def step(c, impl, model, token, cache):
    with torch.no_grad():
        return c.call(impl.decode_step, model, token, cache)


def test_one_step_after_the_prompt(impl):
    model, ids = tiny_model("llama_gqa"), prompt(6)
    c = Case("decode_step(model, token_id, cache)", "prompt of 5 tokens prefilled, then token 6 decoded "
             "(position 5), tiny Llama", shapes="token_id [1] -> logits [B, vocab] = [1, 128] float32",
             hint=HOW, lesson=LESSON)
    cache = after_prefill(model, ids[:, :5])
    logits = step(c, impl, model, ids[:, 5], cache)
    c.close(logits, full_forward_last(model, ids))
    c.equal(cache.length, 6, hint="decode appends one position: call cache.advance(1) after the blocks")


def test_the_new_token_is_written_at_position_length(impl):
    model, ids = tiny_model("llama_gqa"), prompt(6, seed=1)
    c = Case("decode_step(model, token_id, cache)", "prompt of 5 tokens, 1 decode step",
             shapes="cache.k: [n_layers, B, n_kv_heads, max_seq_len, head_dim] = [2, 1, 2, 16, 16]; "
                    "the step writes position 5", hint=HOW, lesson=LESSON)
    cache, ref = after_prefill(model, ids[:, :5]), after_prefill(model, ids)
    step(c, impl, model, ids[:, 5], cache)
    c.close(cache.k[:, :, :, :6], ref.k[:, :, :, :6])
    c.close(cache.v[:, :, :, :6], ref.v[:, :, :, :6])


def test_three_steps_in_a_row(impl):
    model, ids = tiny_model("llama_gqa"), prompt(7, seed=2)
    c = Case("decode_step(model, token_id, cache) x 3", "prompt of 4 tokens, then positions 4, 5, 6",
             shapes="token_id [1] -> logits [1, 128]", hint=HOW, lesson=LESSON)
    cache = after_prefill(model, ids[:, :4])
    for n in range(4, 7):
        logits = step(c, impl, model, ids[:, n], cache)
        c.close(logits, full_forward_last(model, ids[:, : n + 1]))
    c.equal(cache.length, 7)


def test_gpt2_learned_positions(impl):
    model, ids = tiny_model("gpt2"), prompt(6, seed=3)
    c = Case("decode_step(model, token_id, cache) x 2", "tiny GPT-2 (learned positions): prompt of 4, "
             "positions 4 and 5", shapes="token_id [1] -> logits [1, 128]", lesson=LESSON,
             hint="GPT-2 adds model.pos_embed(positions) to the embedding and has no RoPE; " + HOW)
    cache = after_prefill(model, ids[:, :4])
    for n in (4, 5):
        c.close(step(c, impl, model, ids[:, n], cache), full_forward_last(model, ids[:, : n + 1]))


def test_a_batch_of_two(impl):
    model, ids = tiny_model("llama_mqa_tied"), prompt(5, batch=2, seed=4)
    c = Case("decode_step(model, token_id, cache)", "2 sequences with prompts of 4, one token each",
             shapes="token_id [2] -> logits [2, 128]", lesson=LESSON,
             hint="token_id [B] becomes ids [B, 1] (one new token per sequence); " + HOW)
    cache = after_prefill(model, ids[:, :4], max_seq_len=8)
    c.close(step(c, impl, model, ids[:, 4], cache), full_forward_last(model, ids))


def test_far_from_position_0_with_an_explicit_head_dim(impl):
    model, ids = tiny_model("llama_head_dim"), prompt(102, seed=5)
    c = Case("decode_step(model, token_id, cache) x 2", "100 tokens prefilled, then positions 100 and 101; "
             "a tiny Llama whose head_dim (24) is not d_model / n_heads (16)",
             shapes="token_id [1] -> logits [1, 128]", hint=HOW, lesson=LESSON)
    cache = after_prefill(model, ids[:, :100], max_seq_len=110)
    for n in (100, 101):
        logits = step(c, impl, model, ids[:, n], cache)
        c.close(logits, full_forward_last(model, ids[:, : n + 1]), atol=1e-4)
    c.equal(cache.length, 102)


def test_bad_input_is_refused(impl):
    model = tiny_model("llama_gqa")
    cases = [(ValueError, torch.tensor([128]), 16, "token id 128 in a vocabulary of 128 (ids 0..127)"),
             (ValueError, torch.tensor([-1]), 16, "token id -1"),
             (CacheFullError, torch.tensor([3]), 5, "a cache of 5 positions already holding 5 tokens")]
    for error, token, max_seq_len, case in cases:
        c = Case(f"decode_step(model, {token.tolist()}, cache)", case, shapes="token_id [1]", lesson=LESSON,
                 hint="the docstring promises ValueError for a bad id and CacheFullError when there is no room: check "
                      "before the forward pass (0 <= id < model.config.vocab_size; cache.check_room(1)), so the "
                      "student of your code gets that message, not an IndexError from inside torch")
        cache = after_prefill(model, prompt(5), max_seq_len=max_seq_len)
        with torch.no_grad():
            c.raises(error, impl.decode_step, model, token, cache)


# -- issue 30: the whole documented domain, against minillm's decode_step ------------------------------------

REF = reference(EXERCISES["ex07"])


KINDS = ["fits", "takes the last free position", "a negative id", "an id >= vocab", "a full cache",
         "several tokens for one sequence"]
HINT = ("the new token of each sequence sits at position cache.length; logits as float32 whatever the model's dtype; "
        "ValueError for an id outside [0, vocab) (negative ones too) or a token_id whose length is not the cache's "
        "batch (several tokens for one sequence), CacheFullError when cache.length == max_seq_len, both before "
        "the pass; the answer shown is (logits, (cache.length, K and V written, rolling buffers))")


def compare(impl, name, dtype, rolling, batch, kind, prefix_len, n, extra, seed, bad_at):
    """one decode_step after prefix_len cached tokens, the student's against minillm's (n is unused)."""
    free = {"takes the last free position": 1, "a full cache": 0}.get(kind, extra)
    max_seq_len = min(max(prefix_len + free, 1), 128)
    n_tokens = batch + 1 if kind == "several tokens for one sequence" else batch
    token = ids_of(1, n_tokens, seed, kind, bad_at)[0]
    model = model_for(name, dtype)

    def inputs():
        return (model, torch.tensor(token), filled_cache(model, batch, max_seq_len, prefix_len, rolling)), {}

    agree_on_the_cache(impl.decode_step, REF.decode_step, inputs, name, dtype, rolling,
                       f"{kind}: batch {batch}, cache of {max_seq_len} holding {prefix_len}", exercise="ex07",
                       lesson=LESSON, hint=HINT)


def test_agrees_with_the_reference_on_every_kind_of_case_and_dtype(impl):
    for case in table(KINDS):
        compare(impl, **case)


@given(data=st.data())
@settings(CHECKS, max_examples=25)
def test_agrees_with_the_reference_on_random_models_batches_and_positions(impl, data):
    compare(impl, **draw_case(data, KINDS, far_prefix=(100, 126), n=1, extra=(1, 5), bad_at=(0, 2)))
