"""Exercise 20: speculative decoding's expected tokens per verify pass, and the speed-up against the pass's cost."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.registry import EXERCISES, reference

pytestmark = pytest.mark.ex20
LESSON = "lessons/09-optimisations.md#how-many-tokens-a-pass-makes"
REF = reference(EXERCISES["ex20"])
E = ("E = 1 + a + a² + ... + a^k = (1 - a^(k+1)) / (1 - a): draft i counts only if drafts 1..i-1 were kept, and "
     "the pass always adds one token of the model's own (the resample, or the bonus); at a = 1 that is k + 1")
SPEEDUP = "speed-up = E / (k · draft_cost + verify_cost): k draft steps and one verify pass make E tokens"
# The textbook formula loses a few digits as a nears 1 (1 - a^(k+1) cancels): both it and the sum are right.
TOL = (1e-12, 1e-6)


def test_the_expected_tokens_of_a_good_draft(impl):
    c = Case("expected_tokens_per_pass(0.8, 4)", "4 drafts, each accepted with probability 0.8", lesson=LESSON,
             shapes="tokens per pass, a float",
             hint="1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.3616 = (1 - 0.8⁵) / 0.2; " + E)
    c.close(c.call(impl.expected_tokens_per_pass, 0.8, 4), 3.3616, rtol=1e-9, atol=0)


def test_one_draft(impl):
    c = Case("expected_tokens_per_pass(0.6, 1)", "1 draft accepted with probability 0.6", lesson=LESSON,
             shapes="tokens per pass, a float",
             hint="the model's own token always comes, the draft 60 % of the time: 1 + 0.6 = 1.6; " + E)
    c.close(c.call(impl.expected_tokens_per_pass, 0.6, 1), 1.6, rtol=1e-9, atol=0)


def test_a_perfect_draft_gives_k_plus_1(impl):
    for a in (1.0, 1):
        c = Case(f"expected_tokens_per_pass({a!r}, 4)", "every draft is accepted: 4 drafts and the bonus token",
                 lesson=LESSON, shapes="tokens per pass, a float",
                 hint="at a = 1 the formula is 0 / 0; its limit is k + 1 = 5.0 (a float): return it without dividing")
        c.equal(c.call(impl.expected_tokens_per_pass, a, 4), 5.0)


def test_no_acceptance_or_no_draft_is_plain_decoding(impl):
    for a, k, case in [(0.0, 5, "a = 0: every first draft rejected"), (0, 3, "a = 0 given as the int 0"),
                       (0.5, 0, "k = 0: no drafts, a plain decode step")]:
        c = Case(f"expected_tokens_per_pass({a!r}, {k})", case, lesson=LESSON, shapes="tokens per pass, a float",
                 hint="one token per pass, the model's own, as plain decoding makes: 1.0; " + E)
        c.equal(c.call(impl.expected_tokens_per_pass, a, k), 1.0)


def test_expected_tokens_errors(impl):
    for args, case in [((1.5, 3), "a = 1.5"), ((-0.1, 3), "a = -0.1"), ((math.nan, 3), "a = NaN"),
                       ((0.5, -1), "k = -1"), ((0.5, 2.0), "k = 2.0, a float"),
                       ((1.0, -1), "a = 1 (the k + 1 case) with k = -1: checked before the shortcut"),
                       ((1, 2.0), "a = 1 (the k + 1 case) with k = 2.0"),
                       ((0, -1), "a = 0 (the 1.0 case) with k = -1")]:
        c = Case(f"expected_tokens_per_pass({', '.join(map(repr, args))})", case, lesson=LESSON,
                 hint="the docstring promises a ValueError for a outside [0, 1] (NaN too: write `not 0 <= a <= 1`) "
                      "and for k not an integer >= 0")
        c.raises(ValueError, impl.expected_tokens_per_pass, *args)


def test_speedup_with_a_draft_model(impl):
    c = Case("speculative_speedup(0.8, 4, draft_cost=0.05)", "a draft model 20x cheaper than the target, 4 drafts "
             "accepted with probability 0.8, a verify pass costing one decode step", lesson=LESSON,
             shapes="a speed-up, a float", hint="E = 3.3616 tokens for 4 · 0.05 + 1 = 1.2 steps: 2.80133x; " + SPEEDUP)
    c.close(c.call(impl.speculative_speedup, 0.8, 4, 0.05), 3.3616 / 1.2, rtol=1e-9, atol=0)


def test_speedup_of_prompt_lookup_with_a_costly_verify_pass(impl):
    c = Case("speculative_speedup(0.8, 4, draft_cost=0.0, verify_cost=1.32)", "prompt lookup (no draft model: "
             "free) with a verify pass costing 1.32 decode steps, as lesson 09 measured on a CPU", lesson=LESSON,
             shapes="a speed-up, a float", hint="3.3616 / (4 · 0 + 1.32) = 2.5467; " + SPEEDUP)
    c.close(c.call(impl.speculative_speedup, 0.8, 4, 0.0, 1.32), 3.3616 / 1.32, rtol=1e-9, atol=0)


def test_a_poor_draft_slows_decoding_down(impl):
    c = Case("speculative_speedup(0.2, 5, draft_cost=0.1)", "a draft rarely right: 5 drafts at 0.1 steps each",
             lesson=LESSON, shapes="a speed-up, a float",
             hint="E = (1 - 0.2⁶) / 0.8 = 1.24992 tokens for 5 · 0.1 + 1 = 1.5 steps: 0.833x, a slow-down; " + SPEEDUP)
    c.close(c.call(impl.speculative_speedup, 0.2, 5, 0.1), 1.24992 / 1.5, rtol=1e-9, atol=0)


def test_plain_decoding_costs_its_verify_pass(impl):
    for args, expected, case, why in [
            ((0.8, 0, 0.05, 1.32), 1 / 1.32, "k = 0: no drafts, a verify pass costing 1.32 decode steps",
             "E = 1 token for 0 · c + v = 1.32 steps: 1 / 1.32 = 0.758x (the docstring: k = 0 is plain decoding, "
             "1 / v), not 1.0"),
            ((0.3, 0, 0.0, 2.0), 1 / 2.0, "k = 0 with a verify pass twice a decode step", "1 / v = 0.5x"),
            ((0, 4, 0.05, 1.32), 1 / (4 * 0.05 + 1.32), "a = 0: every first draft rejected, 4 drafts at 0.05",
             "E = 1 token for 4 · 0.05 + 1.32 = 1.52 steps: 0.658x")]:
        c = Case(f"speculative_speedup({', '.join(map(repr, args))})", case, lesson=LESSON,
                 shapes="a speed-up, a float", hint=why + "; " + SPEEDUP)
        c.close(c.call(impl.speculative_speedup, *args), expected, rtol=1e-9, atol=0)


def test_speedup_errors(impl):
    for args, case in [((1.2, 3, 0.1), "a = 1.2"), ((0.5, -2, 0.1), "k = -2"), ((0.5, 3, -0.1), "draft_cost = -0.1"),
                       ((0.5, 3, math.nan), "draft_cost = NaN"), ((0.5, 3, 0.1, 0.0), "verify_cost = 0"),
                       ((0.5, 3, 0.1, math.inf), "verify_cost = inf")]:
        c = Case(f"speculative_speedup({', '.join(map(repr, args))})", case, lesson=LESSON,
                 hint="the docstring promises a ValueError for a outside [0, 1], k not an integer >= 0, draft_cost "
                      "< 0 or not finite, verify_cost <= 0 or not finite (NaN included)")
        c.raises(ValueError, impl.speculative_speedup, *args)


# -- differential: every a (0, 1 exactly, near 1), every k (0, large), every cost, and every invalid one ----


VALID = {
    "acceptance_rate": st.sampled_from([0, 0.0, 1, 1.0, 0.5]) | st.floats(0, 1 - 1e-9)
                       | st.floats(1, 9).map(lambda u: 1 - 10 ** -u),  # near 1
    "k": st.integers(0, 3) | st.integers(0, 2000),
    "draft_cost": st.sampled_from([0.0, 0]) | st.floats(0, 10),
    "verify_cost": st.sampled_from([1, 1.0]) | st.floats(1e-3, 20),
}
INVALID = {
    "acceptance_rate": st.floats(1 + 1e-9, 10) | st.floats(-10, -1e-12) | st.just(math.nan),
    "k": st.integers(-5, -1) | st.sampled_from([2.0, 0.5, 3.0]),
    "draft_cost": st.floats(-5, -1e-9) | st.sampled_from([math.nan, math.inf]),
    "verify_cost": st.sampled_from([0.0, -1.0, math.nan, math.inf]),
}


def arguments(data, names):
    """The named arguments: all valid, or exactly one invalid (so each promised error is seen alone)."""
    broken = data.draw(st.sampled_from([None] * len(names) + list(names)), label="invalid argument")
    return {name: data.draw(INVALID[name] if name == broken else VALID[name], label=name) for name in names}


@given(data=st.data())
@CHECKS
def test_expected_tokens_agree_with_the_reference(impl, data):
    args = arguments(data, ["acceptance_rate", "k"])
    a, k = args["acceptance_rate"], args["k"]
    agree(impl.expected_tokens_per_pass, REF.expected_tokens_per_pass, lambda: ((a, k), {}),
          what="expected_tokens_per_pass", exercise="ex20", lesson=LESSON, tol=TOL,
          hint=E + "; a float; ValueError for a outside [0, 1] or NaN, k not an integer >= 0")


@given(data=st.data())
@CHECKS
def test_speedup_agrees_with_the_reference(impl, data):
    args = arguments(data, ["acceptance_rate", "k", "draft_cost", "verify_cost"])
    positional = (args["acceptance_rate"], args["k"], args["draft_cost"])
    kwargs = {"verify_cost": args["verify_cost"]} if data.draw(st.booleans(), label="pass verify_cost") else {}
    if "verify_cost" not in kwargs and not (args["verify_cost"] > 0 and math.isfinite(args["verify_cost"])):
        kwargs = {"verify_cost": args["verify_cost"]}  # the invalid one must be passed
    agree(impl.speculative_speedup, REF.speculative_speedup, lambda: (positional, dict(kwargs)),
          what="speculative_speedup", exercise="ex20", lesson=LESSON, tol=TOL,
          hint=SPEEDUP + " (verify_cost 1 by default); ValueError for a outside [0, 1], k not an integer >= 0, "
                         "draft_cost < 0 or not finite, verify_cost <= 0 or not finite")
