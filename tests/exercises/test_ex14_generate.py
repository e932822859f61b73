"""Exercise 14: the generate loop: prefill, sample, decode_step, stop reasons, step by step."""

import time
from functools import lru_cache

import pytest
import torch

from exercises.checking import Case
from exercises.models import prompt, tiny_model
from minillm import KVCache
from minillm.errors import CacheFullError
from minillm.generate import generate as minillm_generate
from minillm.phases import prefill
from minillm.sampling import SamplingParams

pytestmark = pytest.mark.ex14
LESSON = "lessons/02-prefill-and-decode.md#the-two-phases-at-a-glance"
LOOP = ("logits = prefill(model, prompt_ids, cache); then for n = 1 .. max_new_tokens: token, logprob = "
        "sample(logits, params, generator); reason = the first of eos / stop / length / cache_full that applies; "
        "yield GenerationStep(token_id, logprob, phase, cache.length, time.perf_counter(), reason, "
        "prefill_tokens=T); return if reason; logits = decode_step(model, token, cache); phase = 'decode'")
FIELDS = ("token_id", "logprob", "phase", "cache_length", "finish_reason", "prefill_tokens")
NO_EOS: frozenset[int] = frozenset()


def steps_of(c, impl, model, ids, params, cache, eos):
    """Run the student's loop to the end (a crash or an endless loop past max_new_tokens fails the check)."""
    start, steps = time.perf_counter(), []
    for step in c.call(lambda: list(_bounded(impl.generate(model, ids, params, cache, eos), params))):
        steps.append(step)
    return start, steps


def _bounded(gen, params):
    for n, step in enumerate(gen):
        if n >= params.max_new_tokens:
            raise AssertionError(f"yielded more than max_new_tokens = {params.max_new_tokens} steps")
        yield step


@lru_cache(maxsize=None)
def oracle(prompt_len: int, prefix: int, cache_len: int, params: SamplingParams, eos: frozenset) -> tuple:
    """minillm's own generate on the same tiny model, prompt, settings and cache (computed once per case)."""
    model, ids = tiny_model("llama_gqa"), prompt(prefix + prompt_len, seed=3)[0]
    cache = KVCache.for_model(model, max_seq_len=cache_len)
    if prefix:
        prefill(model, ids[:prefix], cache)
    return tuple(minillm_generate(model, ids[prefix:], params, cache=cache, eos_token_ids=eos))


def compare(c, got, expected):
    c.equal(len(got), len(expected), hint="one step per token, the last one carrying the finish reason; " + LOOP)
    for n, (g, e) in enumerate(zip(got, expected)):
        for field in FIELDS:
            want, have = getattr(e, field), getattr(g, field, None)
            if field == "logprob":
                c.close(have, want, hint=f"step {n + 1}: GenerationStep.logprob; " + LOOP)
            else:
                c.equal(have, want, hint=f"step {n + 1}: GenerationStep.{field}; " + LOOP)


def run_case(impl, what, case, params, eos, prompt_len=5, cache_len=32, prefix=0, hint=LOOP):
    model = tiny_model("llama_gqa")
    ids = prompt(prefix + prompt_len, seed=3)[0]
    cache = KVCache.for_model(model, max_seq_len=cache_len)
    if prefix:
        prefill(model, ids[:prefix], cache)
    c = Case(what, case, shapes=f"prompt_ids [{prompt_len}]; cache of {cache_len} positions, {prefix} filled",
             hint=hint, lesson=LESSON)
    expected = oracle(prompt_len, prefix, cache_len, params, frozenset(eos))
    start, got = steps_of(c, impl, model, ids[prefix:], params, cache, eos)
    compare(c, got, expected)
    return c, start, got, expected, cache


def test_greedy_to_max_new_tokens(impl):
    c, start, got, _, cache = run_case(
        impl, "generate(model, prompt_ids, SamplingParams(max_new_tokens=6), cache, eos_token_ids=set())",
        "greedy, no EOS: 6 tokens, the last with finish_reason 'length'", SamplingParams(max_new_tokens=6), NO_EOS)
    c.equal(cache.length, 5 + 6 - 1, hint="prefill 5 + one decode_step per token except the last: the last token "
                                          "is never decoded (nothing would read its logits)")
    times = [s.time_s for s in got]
    c.true(all(start <= a <= b <= time.perf_counter() for a, b in zip(times, times[1:])),
           "time_s is not time.perf_counter() at each token, in order", expected="non-decreasing perf_counter()",
           got=times)


def test_stops_at_eos_and_yields_it(impl):
    greedy = oracle(5, 0, 32, SamplingParams(max_new_tokens=8), frozenset())
    eos = {greedy[2].token_id}  # the 3rd greedy token ends the request
    run_case(impl, f"generate(model, prompt_ids, SamplingParams(max_new_tokens=8), cache, eos_token_ids={eos})",
             "the 3rd token is an EOS id: 3 steps, the EOS token itself yielded with finish_reason 'eos'",
             SamplingParams(max_new_tokens=8), eos,
             hint="yield the EOS token too (its step carries finish_reason 'eos'), then stop; " + LOOP)


def test_stops_at_a_stop_token_id(impl):
    greedy = oracle(5, 0, 32, SamplingParams(max_new_tokens=8), frozenset())
    stop = greedy[3].token_id
    run_case(impl, f"generate(..., SamplingParams(max_new_tokens=8, stop_token_ids=({stop},)), cache, set())",
             "the 4th token is one of params.stop_token_ids: finish_reason 'stop'",
             SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)), NO_EOS,
             hint="params.stop_token_ids end generation like EOS ids, with finish_reason 'stop'; " + LOOP)


def test_a_full_cache_ends_the_request(impl):
    run_case(impl, "generate(model, prompt_ids, SamplingParams(max_new_tokens=20), cache of 8 positions, set())",
             "a 5-token prompt in a cache of 8 positions: after 4 tokens there is no room to decode the 4th",
             SamplingParams(max_new_tokens=20), NO_EOS, cache_len=8,
             hint="before decoding, check cache.length < cache.max_seq_len; when the cache is full, end with "
                  "finish_reason 'cache_full' instead of calling decode_step (it would raise CacheFullError)")


def test_continues_after_a_long_cached_prefix(impl):
    run_case(impl, "generate(model, prompt_ids, SamplingParams(max_new_tokens=5), cache holding 90 tokens, set())",
             "the cache already holds 90 tokens (a previous turn); the 5-token prompt continues at position 90",
             SamplingParams(max_new_tokens=5), NO_EOS, cache_len=120, prefix=90,
             hint="prefill and decode_step continue from cache.length; cache_length is cache.length after each pass "
                  "(95, 96, ...); " + LOOP)


def test_seeded_sampling_matches(impl):
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=7, max_new_tokens=8)
    run_case(impl, "generate(model, prompt_ids, SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=7, "
                   "max_new_tokens=8), cache, set())", "seeded sampling: the same seed must draw the same tokens",
             params, NO_EOS,
             hint="make ONE generator, generator = params.make_generator(cache.k.device), before the loop, and pass "
                  "it to every sample(logits, params, generator) call; " + LOOP)


def test_bad_prompts_are_refused(impl):
    model = tiny_model("llama_gqa")
    cases = [(ValueError, torch.zeros(0, dtype=torch.long), 16, "an empty prompt"),
             (CacheFullError, prompt(12)[0], 8, "a 12-token prompt for a cache of 8 positions")]
    for error, ids, cache_len, case in cases:
        c = Case("list(generate(model, prompt_ids, SamplingParams(), cache, set()))", case,
                 shapes=f"prompt_ids [{len(ids)}], cache of {cache_len} positions", lesson=LESSON,
                 hint="the docstring promises ValueError for an empty prompt and CacheFullError when the prompt does "
                      "not fit: minillm's prefill raises both, let them through (don't catch them)")
        c.raises(error, lambda: list(impl.generate(model, ids, SamplingParams(), KVCache.for_model(
            model, max_seq_len=cache_len), NO_EOS)))
