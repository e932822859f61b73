"""Exercise 17: the speculative-decoding verification rule (accept, resample, bonus).

Oracles: the residual by hand; the exact probability of every result (n_accepted, token) from
``oracles.speculative_outcomes``, compared with the frequencies over 2,000 seeded draws (the
tolerance is 5 standard deviations of a frequency, so a right rule fails about once in a
million runs); one-hot p and q, where the rule has a single answer.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exercises import oracles
from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.registry import EXERCISES, reference

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
    p = torch.tensor([0.2, 0.3, 0.5])
    c = Case("residual_distribution(p=[0.2, 0.3, 0.5], q=p one float32 step higher in every entry)",
             "p == q up to rounding: max(0, p - q) is 0 everywhere, nothing left over, so p itself",
             shapes="p, q: [vocab]", lesson=LESSON,
             hint="test what is left (the sum of max(0, p - q) is 0), not torch.equal(p, q): rounding leaves p a "
                  "hair below q, and 0 / 0 is NaN; " + RESIDUAL)
    c.close(c.call(impl.residual_distribution, p, torch.nextafter(p, torch.ones_like(p))), p)


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


# -- issue 30: random p and q in every dtype and size, and the seed alone deciding the draws -------------------

REF = reference(EXERCISES["ex17"])
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def random_distributions(seed: int, rows: int, vocab: int, zeros: int, dtype=torch.float32) -> torch.Tensor:
    """[rows, vocab] distributions from a seed, some entries exactly 0 (never a whole row)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 1.5, dim=-1)
    for row in probs:
        row[torch.randperm(vocab, generator=g)[: min(zeros, vocab - 1)]] = 0.0
    return (probs / probs.sum(-1, keepdim=True)).to(dtype)


@given(data=st.data())
@settings(CHECKS, max_examples=30)
def test_residual_agrees_with_the_reference(impl, data):
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    vocab = data.draw(st.integers(1, 50), label="vocab")
    seed = data.draw(st.integers(0, 99), label="seed")
    p = random_distributions(seed, 1, vocab, data.draw(st.integers(0, 3), label="zeros in p"), dtype)[0]
    q_kind = data.draw(st.sampled_from(["random", "p itself", "one-hot"]), label="q")
    q = {"random": lambda: random_distributions(seed + 1, 1, vocab, data.draw(st.integers(0, 3), label="zeros in q"),
                                                dtype)[0],
         "p itself": lambda: p.clone(),
         "one-hot": lambda: torch.nn.functional.one_hot(torch.tensor(data.draw(st.integers(0, vocab - 1))),
                                                        vocab).to(dtype)}[q_kind]()
    as_p = lambda fn: (lambda p, q: _in_dtype(fn(p, q), p.dtype))  # noqa: E731 - "float": any float dtype will do
    agree(as_p(impl.residual_distribution), as_p(REF.residual_distribution), lambda: ((p.clone(), q.clone()), {}),
          what="residual_distribution", exercise="ex17", lesson=LESSON,
          hint=RESIDUAL + "; when nothing is left (p == q) return p itself, not 0 / 0 = NaN; "
               "leave p and q as they were")


def _in_dtype(x, dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _outcomes_of(fn, p, q, drafts, n: int, seed: int) -> dict:
    gen, counts = torch.Generator().manual_seed(seed), {}
    for _ in range(n):
        got = fn(p, q, drafts, gen)
        counts[got] = counts.get(got, 0) + 1
    return counts


@given(data=st.data())
@settings(CHECKS, max_examples=25)
def test_accept_or_resample_follows_the_rule_on_random_distributions(impl, data):
    """Any draw: (int, int) in the rule's support; over 200 draws: the rule's exact probabilities (5.5 sd)."""
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), label="dtype")
    vocab = data.draw(st.integers(2, 6), label="vocab")
    k = data.draw(st.integers(0, 3), label="k drafts")
    seed = data.draw(st.integers(0, 99), label="seed")
    p = random_distributions(seed, k + 1, vocab, data.draw(st.integers(0, 2), label="zeros in p"), dtype)
    deterministic = data.draw(st.booleans(), label="deterministic draft (q None)")
    q = None if deterministic else random_distributions(seed + 1, k, vocab, data.draw(st.integers(0, 2)), dtype)
    g = torch.Generator().manual_seed(seed)
    drafts = [int(torch.randint(vocab, (), generator=g)) if q is None else
              int(torch.multinomial(q[i].double(), 1, generator=g)) for i in range(k)]
    expected = oracles.speculative_outcomes(p.double().tolist(), None if q is None else q.double().tolist(), drafts)
    n = 200
    c = Case(f"accept_or_resample(p, {'None' if q is None else 'q'}, {drafts}) x {n}",
             f"random p [{k + 1}, {vocab}]{'' if q is None else f' and q [{k}, {vocab}]'} in {str(dtype)[6:]}",
             shapes="-> (n_accepted: int, token: int)", hint=RULE + "; return Python ints (.item())", lesson=LESSON)
    counts = c.call(_outcomes_of, impl.accept_or_resample, p, q, drafts, n, seed)
    for got in counts:
        c.true(isinstance(got, tuple) and len(got) == 2 and all(type(x) is int for x in got),
               "not a pair of Python ints", expected="(n_accepted, token) as ints", got=repr(got))
        c.true(expected.get(got, 0.0) > 0, f"{got} cannot come out of the rule", expected=sorted(expected), got=got)
    for key in set(expected) | set(counts):
        want, have = expected.get(key, 0.0), counts.get(key, 0) / n
        c.true(abs(have - want) <= 5.5 * (want * (1 - want) / n) ** 0.5 + 0.02,
               f"{key} came out {have:.3f} of the time", expected=f"{want:.3f}", got=f"{have:.3f}")


# A flat target and a draft that over-proposes each draft: the accept test (ratio 0.5), the resample (from 15
# tokens) and the bonus (from 16) are all random, so a draw from anything but the generator shows.
FLAT_P = torch.full((3, 16), 1 / 16)
FLAT_Q = torch.full((2, 16), 0.875 / 15).index_put_((torch.tensor([0, 1]), torch.tensor([3, 5])), torch.tensor(0.125))


def _seeded_runs(impl, seed: int, global_seed: int, n: int = 40) -> list[tuple]:
    with torch.random.fork_rng():
        torch.manual_seed(global_seed)
        g = torch.Generator().manual_seed(seed)
        return [tuple(int(x) for x in impl.accept_or_resample(FLAT_P, FLAT_Q, [3, 5], g)) for _ in range(n)]


def test_the_generator_alone_decides_the_outcome(impl):
    c = Case("accept_or_resample(p, q, [3, 5], Generator().manual_seed(s)) x 40",
             "p flat over 16 tokens, q(d) = 0.125 (kept half the time): the same seed after torch.manual_seed(1) and "
             "after torch.manual_seed(2), then seeds 7 and 8", shapes="p [3, 16], q [2, 16]", lesson=LESSON,
             hint="every random number from the generator given: the accept test's u = torch.rand((), "
                  "generator=generator, device=p.device), the replacement and the bonus with torch.multinomial(probs, "
                  "1, generator=generator); the global RNG (torch.manual_seed) must not change the outcome")
    first = c.call(_seeded_runs, impl, 7, 1)
    c.equal(c.call(_seeded_runs, impl, 7, 2), first)
    c.true(c.call(_seeded_runs, impl, 8, 1) != first, "generators seeded 7 and 8 gave the same 40 outcomes",
           expected="different outcomes", got=first[:8])
