"""Exercise 17: the speculative-decoding verification rule (accept, resample, bonus).

Oracles: the residual by hand; the exact probability of every result (n_accepted, token) from
``oracles.speculative_outcomes``, compared with the frequencies over 2,000 seeded draws (the
tolerance is 5 standard deviations of a frequency, so a right rule fails about once in a
million runs); one-hot p and q, where the rule has a single answer.
"""

import pytest
import torch

from exercises import oracles
from exercises.checking import Case

pytestmark = pytest.mark.ex17
LESSON = "lessons/09-optimisations.md#speculative-decoding-one-step-at-a-time"
N_DRAWS = 2000
TOLERANCE = 0.05  # 5 sd of a frequency over 2,000 draws (sd <= 0.5 / sqrt(2000) = 0.011)
RESIDUAL = ("the residual is max(0, p - q), elementwise (a token q over-proposed gets 0, never a negative "
            "weight), divided by its sum so that it is a distribution (it sums to 1)")
ACCEPT = ("keep draft d with probability min(1, p(d) / q(d)): draw u uniform in [0, 1) and keep when u < p(d) / q(d); "
          "a deterministic draft (q None) is one-hot, so q(d) = 1 and d is kept with probability p(d)")
RULE = (ACCEPT + "; at the first rejection i stop and draw the replacement from normalize(max(0, p_i - q_i)); "
        "when all k drafts are kept, add the bonus token drawn from p_k (the last row of p)")


def _frequencies(impl, p, q, drafts, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(N_DRAWS):
        n_accepted, token = impl.accept_or_resample(p, q, drafts, gen)
        key = (int(n_accepted), None if token is None else int(token))
        counts[key] = counts.get(key, 0) + 1
    return {key: n / N_DRAWS for key, n in counts.items()}


def _check_outcomes(c: Case, impl, p, q, drafts) -> None:
    expected = oracles.speculative_outcomes(p.tolist(), None if q is None else q.tolist(), drafts)
    got = c.call(_frequencies, impl, p, q, drafts)
    keys = sorted(set(expected) | set(got), key=str)
    worst = max(keys, key=lambda key: abs(got.get(key, 0.0) - expected.get(key, 0.0)))
    shown = lambda d: ", ".join(f"{k}: {d.get(k, 0.0):.3f}" for k in keys)  # noqa: E731
    c.true(abs(got.get(worst, 0.0) - expected.get(worst, 0.0)) <= TOLERANCE,
           f"wrong frequencies of (n_accepted, token) over {N_DRAWS} draws (worst: {worst})",
           expected=shown(expected), got=shown(got))


def test_residual_by_hand(impl):
    for p, q, expected in [([0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.1, 0.2], [0.8, 0.0, 0.2, 0.0]),
                           ([0.1, 0.1, 0.8], [0.0, 0.5, 0.5], [0.25, 0.0, 0.75]),
                           ([0.2, 0.3, 0.5], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5])]:
        c = Case(f"residual_distribution(p={p}, q={q})",
                 "p == q: nothing left over, the docstring says p itself" if p == q else
                 f"max(0, p - q) = {[round(max(0, a - b), 3) for a, b in zip(p, q)]}, then / its sum",
                 shapes="p, q: [vocab]", hint=RESIDUAL, lesson=LESSON)
        got = c.call(impl.residual_distribution, torch.tensor(p), torch.tensor(q))
        c.close(got, torch.tensor(expected))


def test_one_hot_p_keeps_drafts_until_the_first_miss(impl):
    # p's rows are one-hot: the model is sure of 1, then 2, then 0, then 3 (the bonus row)
    p = torch.nn.functional.one_hot(torch.tensor([1, 2, 0, 3]), 4).float()
    for drafts, expected, case in [([1, 2, 0], (3, 3), "all 3 drafts are what the model would say: 3 kept + bonus 3"),
                                   ([1, 0, 0], (1, 2), "draft 2 is wrong: 1 kept, then the model's own token 2; "
                                                       "draft 3 is right but comes after a rejection"),
                                   ([3, 2, 0], (0, 1), "the first draft is wrong: none kept, the model's token 1"),
                                   ([], (0, 1), "no drafts: a plain decode step, the token from p_0")]:
        c = Case(f"accept_or_resample(p, None, {drafts})", case + " (p one-hot: [1, 2, 0, 3][:k+1])",
                 shapes=f"p [{len(drafts) + 1}, 4]", hint=RULE, lesson=LESSON)
        got = c.call(impl.accept_or_resample, p[: len(drafts) + 1], None, drafts, torch.Generator().manual_seed(0))
        c.equal(c.call(_as_pair, got), expected)


def _as_pair(got) -> tuple:
    n_accepted, token = got
    return int(n_accepted), None if token is None else int(token)


def test_bonus_token_comes_from_the_last_row(impl):
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.0, 0.5]])
    c = Case("accept_or_resample(p, None, [1, 2])", "both drafts certain to be kept; the bonus is drawn from "
             "p_2 = [0.5, 0, 0.5]: token 0 or 2, half the time each", shapes="p [3, 3]", hint=RULE, lesson=LESSON)
    _check_outcomes(c, impl, p, None, [1, 2])


def test_a_draft_is_kept_with_probability_p_over_q(impl):
    p = torch.tensor([[0.3, 0.5, 0.2], [0.1, 0.1, 0.8]])
    for q_row, case in [([0.6, 0.2, 0.2], "q(0) = 0.6 > p(0) = 0.3: kept half the time; a rejection draws from the "
                                          "residual [0, 1, 0]"),
                        ([0.15, 0.6, 0.25], "q(0) = 0.15 < p(0) = 0.3: always kept, then the bonus from p_1")]:
        c = Case(f"accept_or_resample(p, q=[{q_row}], [0])", case, shapes="p [2, 3], q [1, 3]", hint=RULE,
                 lesson=LESSON)
        _check_outcomes(c, impl, p, torch.tensor([q_row]), [0])


def test_a_deterministic_draft_is_kept_with_probability_p(impl):
    p = torch.tensor([[0.25, 0.5, 0.25], [0.6, 0.2, 0.2], [0.0, 0.0, 1.0]])
    c = Case("accept_or_resample(p, None, [0, 0])", "prompt lookup proposed 0, 0 (q one-hot): kept with "
             "probability p(0) = 0.25, then 0.6; the residual of a rejection is p without the draft",
             shapes="p [3, 3]", hint=RULE, lesson=LESSON)
    _check_outcomes(c, impl, p, None, [0, 0])


def test_tokens_follow_p_whatever_the_draft(impl):
    """The theorem: d ~ q, then the kept or resampled token is distributed as p."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])
    gen = torch.Generator().manual_seed(1)
    c = Case("accept_or_resample(p, q, [d]) with d ~ q", "the first token (the kept draft, or the replacement) "
             "over 2,000 draws must be distributed as p_0 = [0.5, 0.3, 0.2, 0]", shapes="p [2, 4], q [1, 4]",
             hint=RULE, lesson=LESSON)
    counts = torch.zeros(4)
    for _ in range(N_DRAWS):
        d = torch.multinomial(q[0], 1, generator=gen).item()
        n_accepted, token = c.call(impl.accept_or_resample, p, q, [d], gen)
        first = d if n_accepted else token
        c.true(first is not None and 0 <= int(first) < 4, "a token outside the vocabulary", got=first)
        counts[int(first)] += 1
    c.close(counts / N_DRAWS, p[0], atol=TOLERANCE, rtol=0)
