"""Exercise 20: the speculative speed-up, expected tokens per verify pass against its cost.

Write ``expected_tokens_per_pass(acceptance_rate, k)``: Leviathan et al.'s expected tokens per
verify pass, (1 - a^(k+1)) / (1 - a); then ``speculative_speedup(acceptance_rate, k, draft_cost,
verify_cost)``: those tokens over the time the pass took, in target decode steps.

Check:      minillm check ex20   (or: pytest tests/exercises -m ex20 --impl student)
Lesson:     lessons/09-optimisations.md#how-many-tokens-a-pass-makes
Reference:  minillm.speculative.expected_tokens_per_pass, minillm.speculative.speculative_speedup
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import math
import numbers


def expected_tokens_per_pass(acceptance_rate: float, k: int) -> float:
    """Tokens one verify pass yields on average, if each draft is accepted with probability a.

        E = 1 + a + a² + ... + a^k = (1 - a^(k+1)) / (1 - a)          (k + 1 when a = 1)

    Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
    equation (1). The pass keeps draft i only if drafts 1..i-1 were kept, and always adds one
    token of the target's own (the resample at the first rejection, or the bonus after k
    acceptances): so E runs from 1 (a = 0, or k = 0: plain decoding) to k + 1 (a = 1).
    It assumes every draft is accepted independently with the same a; real acceptances come
    in runs (easy stretches of text accept long runs), so a measured mean acceptance length
    (:attr:`SpeculativeStats.mean_acceptance_length`) is usually above E at the same a.

    Args:
        acceptance_rate: a, the probability that a draft token is accepted, 0 <= a <= 1
            (an int 0 or 1 is fine).
        k: drafts proposed per pass, an integer >= 0.

    Returns E, tokens per pass, a float.
    Raises ValueError for a outside [0, 1] (NaN included), or k not an integer (2.0 is not) or < 0.
    """
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    if not 0 <= acceptance_rate <= 1:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate!r}")
    a = float(acceptance_rate)
    k = int(k)
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def speculative_speedup(acceptance_rate: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Expected speed-up of speculative decoding over plain decoding: tokens per unit of time.

        speed-up = E / (k · c + v),   E = expected_tokens_per_pass(a, k)

    One pass runs the draft k times (c each, in target decode steps) and one verify pass of
    k + 1 tokens (v target decode steps), and yields E tokens; plain decoding yields 1 token
    per step. With v = 1, Leviathan et al. 2023's assumption that checking k + 1 tokens costs
    one decode step (memory-bound decode), this is their Theorem 3.8, (1 - a^(k+1)) /
    ((1 - a)(k·c + 1)). A measured v above 1 (lesson 09: a verify pass of 1 + 5 tokens on a
    CPU) lowers it. Below 1, speculation slows decoding down.

    Args:
        acceptance_rate: a, 0 <= a <= 1.
        k: drafts per pass, an integer >= 0 (k = 0 is plain decoding: 1 / v).
        draft_cost: c, one draft step's time over one target decode step, finite and >= 0
            (0 for prompt lookup, which runs no model).
        verify_cost: v, a verify pass's time over one target decode step, finite and > 0.

    Returns the speed-up, a float.
    Raises ValueError for a outside [0, 1], k not an integer or < 0, draft_cost < 0 or not
    finite, verify_cost <= 0 or not finite (NaN included).
    """
    if not (math.isfinite(draft_cost) and draft_cost >= 0):
        raise ValueError(f"draft_cost must be finite and >= 0, got {draft_cost!r}")
    if not (math.isfinite(verify_cost) and verify_cost > 0):
        raise ValueError(f"verify_cost must be finite and > 0, got {verify_cost!r}")
    e = expected_tokens_per_pass(acceptance_rate, k)
    return float(e / (k * draft_cost + verify_cost))
