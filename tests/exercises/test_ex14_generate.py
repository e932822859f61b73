"""Exercise 14: the generate loop: prefill, sample, decode_step, stop reasons, step by step."""

import copy
import itertools
import random
import time
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.registry import EXERCISES, reference
from exercises.models import prompt, tiny_model
from minillm import KVCache
from minillm.errors import CacheFullError
from minillm.phases import prefill
from minillm.sampling import SamplingParams

pytestmark = pytest.mark.ex14
REF = reference(EXERCISES["ex14"])  # minillm.generate.generate itself
LESSON = "lessons/02-prefill-and-decode.md#the-two-phases-at-a-glance"
LOOP = ("generator = params.make_generator(cache.k.device), made once, before the loop; "
        "logits = prefill(model, prompt_ids, cache); then for n = 1 .. max_new_tokens: token, logprob = "
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
    """minillm's own generate (the reference) on the same tiny model, prompt, settings and cache (once per case)."""
    model, ids = tiny_model("llama_gqa"), prompt(prefix + prompt_len, seed=3)[0]
    cache = KVCache.for_model(model, max_seq_len=cache_len)
    if prefix:
        prefill(model, ids[:prefix], cache)
    return tuple(REF.generate(model, ids[prefix:], params, cache=cache, eos_token_ids=eos))


def compare(c, got, expected):
    """Step by step, field by field; a failure's hint names the step and field, then the case's own hint."""
    c.equal(len(got), len(expected), hint="one step per token, the last one carrying the finish reason; " + c.hint)
    for n, (g, e) in enumerate(zip(got, expected)):
        for field in FIELDS:
            want, have = getattr(e, field), getattr(g, field, None)
            if field == "logprob":
                c.close(have, want, hint=f"step {n + 1}: GenerationStep.logprob; " + c.hint)
            else:
                c.equal(have, want, hint=f"step {n + 1}: GenerationStep.{field}; " + c.hint)


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
             hint="make the generator once, before the loop: generator = params.make_generator(cache.k.device), "
                  "then pass it to every sample(logits, params, generator) call (one made at every step starts "
                  "each token's draw from the seed again)")


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


# -- issue 30: every prompt, prefix, cache size, stop set and seed, against minillm's generate --------------

FIELDS_COMPARED = ("token_id", "logprob", "phase", "cache_length", "finish_reason", "prefill_tokens")


def _steps(generate_fn):
    """Run a loop to its end (at most max_new_tokens + 1 steps): every step's fields but the time, then
    cache.length."""
    def run(model, prompt_ids, params, cache, eos_token_ids):
        steps = generate_fn(model, prompt_ids, params, cache, eos_token_ids)
        steps = itertools.islice(steps, params.max_new_tokens + 1)
        return [tuple(getattr(s, f, None) for f in FIELDS_COMPARED) for s in steps], cache.length
    run.__name__ = "generate"
    return run


def _some_ids(data, label: str) -> set[int]:
    """A seeded random set of 0 to 40 of the 128 ids (drawn as a size and a seed: quick to shrink)."""
    size = data.draw(st.integers(0, 40), label=f"how many {label}")
    return set(random.Random(data.draw(st.integers(0, 9), label=f"{label} seed")).sample(range(128), size))


@given(data=st.data())
@settings(CHECKS, max_examples=30)
def test_agrees_with_the_reference_on_every_prompt_cache_and_stop(impl, data):
    model = tiny_model("llama_gqa")
    prompt_len = data.draw(st.sampled_from([0, 1, 2, 5, 8]), label="prompt length")  # 0: ValueError
    prefix = data.draw(st.sampled_from([0, 0, 3, 90]), label="cached prefix")
    room = data.draw(st.integers(-1, 8), label="room after the prompt")  # -1: CacheFullError
    cache_len = max(prefix + prompt_len + room, prefix, 1)
    sampled = data.draw(st.booleans(), label="seeded sampling")
    eos = frozenset(_some_ids(data, "eos ids"))
    params = SamplingParams(
        temperature=1.2 if sampled else 0.0, top_k=30 if sampled else 0, seed=data.draw(st.integers(0, 99)) if sampled
        else None, max_new_tokens=data.draw(st.integers(1, 8), label="max_new_tokens"),
        stop_token_ids=tuple(sorted(_some_ids(data, "stop ids"))))
    ids = prompt(prefix + prompt_len, seed=data.draw(st.integers(0, 3), label="prompt seed"))[0]

    filled = KVCache.for_model(model, max_seq_len=cache_len)
    if prefix:
        prefill(model, ids[:prefix], filled)

    def inputs():
        return (model, ids[prefix:].clone(), params, copy.deepcopy(filled), set(eos)), {}

    agree(_steps(impl.generate), _steps(REF.generate), inputs, exercise="ex14", lesson=LESSON,
          what=f"generate (cache of {cache_len} holding {prefix}) -> ([(token_id, logprob, phase, cache_length, "
               "finish_reason, prefill_tokens) per step], cache.length at the end)",
          hint="token_id an int (token.item()), logprob a float; the reason is the first of eos, stop, length, "
               "cache_full that applies (an EOS as the last allowed token is 'eos', not 'length'); "
               "prefill_tokens = len(prompt_ids); " + LOOP)


def test_steps_hold_python_numbers(impl):
    model = tiny_model("llama_gqa")
    c = Case("generate(model, prompt_ids, SamplingParams(max_new_tokens=3), cache, set())",
             "the types of GenerationStep's fields", shapes="token_id: int, logprob: float, cache_length: int",
             lesson=LESSON, hint="yield token.item() and logprob.item(): a one-element tensor is not an int (a set of "
                                 "EOS ids does not match it, json cannot write it, and it keeps the tensor alive)")
    steps = c.call(lambda: list(impl.generate(model, prompt(5, seed=3)[0], SamplingParams(max_new_tokens=3),
                                              KVCache.for_model(model, max_seq_len=16), set())))
    for step in steps:
        for field, kind in (("token_id", int), ("logprob", float), ("cache_length", int), ("prefill_tokens", int)):
            value = getattr(step, field)
            c.true(type(value) is kind, f"GenerationStep.{field} is a {type(value).__name__}",
                   expected=kind.__name__, got=repr(value))


def test_eos_or_stop_as_the_last_allowed_token(impl):
    greedy = oracle(5, 0, 32, SamplingParams(max_new_tokens=8), frozenset())
    last = greedy[2].token_id
    for params, eos, reason in [(SamplingParams(max_new_tokens=3), {last}, "eos"),
                                (SamplingParams(max_new_tokens=3, stop_token_ids=(last,)), set(), "stop")]:
        stop = "" if eos else f", stop_token_ids=({last},)"
        run_case(impl, f"generate(..., SamplingParams(max_new_tokens=3{stop}), cache, eos_token_ids={eos or set()})",
                 f"the 3rd token, the last max_new_tokens allows, is {'an EOS id' if eos else 'a stop id'}: "
                 f"finish_reason '{reason}', not 'length'", params, eos,
                 hint="the docstring's order: eos, then stop, then length, then cache_full (the first that applies); "
                      "check the token before the count; " + LOOP)


def test_a_token_is_stamped_after_its_forward_pass(impl):
    """time_s is when the token was known: after the pass that produced it (TTFT includes the prefill)."""
    model = tiny_model("llama_gqa")
    ends, received = [], []
    handle = model.lm_head.register_forward_hook(lambda *_: ends.append(time.perf_counter()))
    c = Case("generate(model, prompt_ids, SamplingParams(max_new_tokens=4), cache, set())",
             "each pass's end is recorded (a hook on lm_head); token n must be stamped after pass n ended and before "
             "the caller got it", shapes="prompt_ids [5]; 4 tokens: 1 prefill + 3 decode passes", lesson=LESSON,
             hint="stamp time.perf_counter() after prefill / decode_step returned the logits the token was sampled "
                  "from, not before the pass (then the TTFT would leave out the whole prefill); " + LOOP)
    try:
        for step in c.call(impl.generate, model, prompt(5, seed=3)[0], SamplingParams(max_new_tokens=4),
                           KVCache.for_model(model, max_seq_len=16), set()):
            received.append((step.time_s, time.perf_counter()))
    finally:
        handle.remove()
    c.equal(len(ends), 4, hint="one forward pass per token except the last (prefill + 3 decode steps)")
    for n, ((stamp, got_at), end) in enumerate(zip(received, ends)):
        c.true(end <= stamp <= got_at, f"token {n + 1} stamped {'before its pass ended' if stamp < end else 'late'}",
               expected=f"{end:.6f} <= time_s <= {got_at:.6f}", got=f"time_s = {stamp:.6f}")


def _seeded_tokens(impl, global_seed: int, seed: int = 11) -> list[int]:
    model = tiny_model("llama_gqa")
    params = SamplingParams(temperature=1.5, seed=seed, max_new_tokens=8)
    with torch.random.fork_rng():
        torch.manual_seed(global_seed)
        return [int(s.token_id) for s in impl.generate(model, prompt(4, seed=5)[0], params,
                                                          KVCache.for_model(model, max_seq_len=16), set())]


def test_the_seed_alone_decides_the_tokens(impl):
    c = Case("generate(..., SamplingParams(temperature=1.5, seed=11, max_new_tokens=8), ...) twice",
             "the same seed after torch.manual_seed(1) and after torch.manual_seed(2)", shapes="prompt_ids [4]",
             lesson=LESSON, hint="make the generator once, before the loop: params.make_generator(cache.k.device), "
                                 "passed to every sample(...): the global RNG must not matter")
    c.equal(c.call(_seeded_tokens, impl, 2), c.call(_seeded_tokens, impl, 1))
