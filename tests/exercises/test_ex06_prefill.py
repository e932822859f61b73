"""Exercise 6: prefill, the whole prompt in one forward pass that fills the KV cache."""

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

pytestmark = pytest.mark.ex06
LESSON = "lessons/02-prefill-and-decode.md#prefill"
HOW = ("positions = arange(cache.length, cache.length + T); x = embed(ids) (+ pos_embed(positions) for GPT-2); "
       "cos/sin = model.rope(positions, x.dtype) for Llama; every block(x, cos_sin, cache, model.attn_impl, hook); "
       "cache.advance(T); logits = lm_head(ln_final(x[:, -1])).float()")


def run(c, impl, model, ids, cache):
    with torch.no_grad():
        return c.call(impl.prefill, model, ids, cache)


def test_logits_of_the_last_prompt_token(impl):
    model, ids = tiny_model("llama_gqa"), prompt(6)
    c = Case("prefill(model, ids, cache)", "a 6-token prompt, empty cache, tiny Llama (GQA, RoPE)",
             shapes="ids [1, 6] -> logits [B, vocab] = [1, 128] float32", hint=HOW, lesson=LESSON)
    logits = run(c, impl, model, ids, KVCache.for_model(model, max_seq_len=16))
    c.close(logits, full_forward_last(model, ids), hint="return the logits of the LAST prompt position "
            "(they predict the first new token), [B, vocab] in float32; " + HOW)


def test_the_cache_holds_the_prompt(impl):
    model, ids = tiny_model("llama_gqa"), prompt(6)
    c = Case("prefill(model, ids, cache)", "a 6-token prompt, empty cache of 16 positions",
             shapes="cache.k: [n_layers, B, n_kv_heads, 16, head_dim] = [2, 1, 2, 16, 16]", lesson=LESSON,
             hint="each layer writes its K/V (the blocks do it through cache.write); afterwards call "
                  "cache.advance(T) once, so cache.length == 6")
    cache, ref = KVCache.for_model(model, max_seq_len=16), KVCache.for_model(model, max_seq_len=16)
    run(c, impl, model, ids, cache)
    prefill(model, ids, ref)
    c.equal(cache.length, 6)
    c.close(cache.k[:, :, :, :6], ref.k[:, :, :, :6])
    c.close(cache.v[:, :, :, :6], ref.v[:, :, :, :6])


def test_prefill_onto_a_filled_cache(impl):
    model, ids = tiny_model("llama_gqa"), prompt(7, seed=1)
    c = Case("prefill(model, ids[:, 4:], cache)", "the last 3 tokens of a 7-token prompt, after 4 cached ones "
             "(how a prefix-cache hit is used)", shapes="ids [1, 3]; cache.length 4 -> 7", lesson=LESSON,
             hint="positions start at cache.length (here 4, 5, 6), not 0; " + HOW)
    cache = KVCache.for_model(model, max_seq_len=16)
    prefill(model, ids[:, :4], cache)
    logits = run(c, impl, model, ids[:, 4:], cache)
    c.equal(cache.length, 7)
    c.close(logits, full_forward_last(model, ids))


def test_gpt2_learned_positions(impl):
    model, ids = tiny_model("gpt2"), prompt(5, seed=2)
    c = Case("prefill(model, ids, cache)", "a 5-token prompt then 2 more, tiny GPT-2 (learned positions, no RoPE)",
             shapes="ids [1, 5] then [1, 2] -> logits [1, 128]", lesson=LESSON,
             hint="GPT-2 has model.pos_embed and model.rope is None: x = embed(ids) + pos_embed(positions), "
                  "and the blocks get rope_cos_sin=None; " + HOW)
    cache = KVCache.for_model(model, max_seq_len=16)
    c.close(run(c, impl, model, ids, cache), full_forward_last(model, ids))
    more = prompt(2, seed=3)
    c.close(run(c, impl, model, more, cache), full_forward_last(model, torch.cat([ids, more], dim=1)))


def test_a_batch_of_two_prompts(impl):
    model, ids = tiny_model("llama_mqa_tied"), prompt(5, batch=2, seed=4)
    c = Case("prefill(model, ids, cache)", "2 prompts of 5 tokens, tiny Llama with 1 K/V head",
             shapes="ids [2, 5] -> logits [2, 128]", hint=HOW, lesson=LESSON)
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=8)
    c.close(run(c, impl, model, ids, cache), full_forward_last(model, ids))


def test_far_from_position_0_with_an_explicit_head_dim(impl):
    model, ids = tiny_model("llama_head_dim"), prompt(110, seed=6)
    c = Case("prefill(model, ids[:, 100:], cache)", "10 more tokens after 100 cached ones (positions 100..109); "
             "a tiny Llama whose head_dim (24) is not d_model / n_heads (16)", shapes="ids [1, 10] -> logits [1, 128]",
             hint="positions start at cache.length (100), and every size comes from the config (head_dim 24); " + HOW,
             lesson=LESSON)
    cache = KVCache.for_model(model, max_seq_len=112)
    prefill(model, ids[:, :100], cache)
    c.close(run(c, impl, model, ids[:, 100:], cache), full_forward_last(model, ids), atol=1e-4)
    c.equal(cache.length, 110)


def test_bad_input_is_refused(impl):
    model = tiny_model("llama_gqa")
    cases = [(ValueError, torch.zeros(1, 0, dtype=torch.long), 16, "an empty prompt, ids [1, 0]"),
             (ValueError, torch.tensor([[5, 128, 7]]), 16, "token id 128 in a vocabulary of 128 (ids 0..127)"),
             (ValueError, torch.tensor([[5, -1, 7]]), 16, "token id -1 (embedding would raise IndexError)"),
             (CacheFullError, prompt(9), 8, "a 9-token prompt for a cache of 8 positions")]
    for error, ids, max_seq_len, case in cases:
        c = Case(f"prefill(model, {list(ids.shape)} ids, cache)", case, shapes=f"ids {list(ids.shape)}",
                 lesson=LESSON,
                 hint="the docstring promises ValueError for an empty prompt or an id outside the vocabulary and "
                      "CacheFullError when the prompt does not fit: check before the forward pass (ids.numel(), "
                      "0 <= ids < model.config.vocab_size, cache.check_room(T)), not an IndexError from inside torch")
        with torch.no_grad():
            c.raises(error, impl.prefill, model, ids, KVCache.for_model(model, max_seq_len=max_seq_len))


# -- issue 30: the whole documented domain, against minillm's prefill ----------------------------------------

REF = reference(EXERCISES["ex06"])


KINDS = ["fits", "fills the cache", "a negative id", "an id >= vocab", "overflows", "an empty prompt"]
HINT = ("positions start at cache.length; logits of the last position as float32 whatever the model's dtype; every "
        "row of the batch; ValueError for an empty prompt or any id outside [0, vocab) (negative ones too), "
        "CacheFullError when cache.length + T > max_seq_len, both before the pass; the answer shown is "
        "(logits, (cache.length, K and V written, rolling buffers))")


def compare(impl, name, dtype, rolling, batch, kind, prefix_len, n, extra, seed, bad_at):
    """prefill of n seeded tokens after prefix_len cached ones, the student's against minillm's."""
    if kind == "fills the cache":
        extra = 0
    if kind == "an empty prompt":
        n = 0
    max_seq_len = min(max(prefix_len + n + (-extra if kind == "overflows" else extra), prefix_len, 1), 128)
    ids = ids_of(batch, n, seed, kind, bad_at)
    model = model_for(name, dtype)

    def inputs():
        ids_tensor = torch.tensor(ids, dtype=torch.long).reshape(batch, n)
        return (model, ids_tensor, filled_cache(model, batch, max_seq_len, prefix_len, rolling)), {}

    agree_on_the_cache(impl.prefill, REF.prefill, inputs, name, dtype, rolling,
                       f"{kind}: cache of {max_seq_len} holding {prefix_len}", exercise="ex06", lesson=LESSON,
                       hint=HINT)


def test_agrees_with_the_reference_on_every_kind_of_case_and_dtype(impl):
    for case in table(KINDS):
        compare(impl, **case)


@given(data=st.data())
@settings(CHECKS, max_examples=25)
def test_agrees_with_the_reference_on_random_models_batches_and_prefixes(impl, data):
    compare(impl, **draw_case(data, KINDS, far_prefix=(90, 110), n=(1, 10), extra=(1, 6), bad_at=(0, 9)))
