"""Exercise 8: sampling: greedy, temperature, top-k and top-p (nucleus)."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.registry import EXERCISES, reference
from exercises.oracles import filter_row
from minillm.sampling import SamplingParams

pytestmark = pytest.mark.ex08
LESSON = "lessons/07-sampling.md"
INF = float("inf")
TOP_P = ("sort the tokens by probability (softmax of the logits, not the raw logits), keep each token "
         "while the probability mass BEFORE it is < top_p: the token that crosses top_p stays, and so "
         "does the most likely token; map the kept set back to the original (unsorted) order")


def logits_of(probs: list[float], shift: float = 3.0) -> torch.Tensor:
    """[1, vocab] logits whose softmax is ``probs`` (shifted: logits are not log-probabilities)."""
    return torch.tensor([probs]).log() + shift


def test_greedy_takes_the_argmax(impl):
    logits = torch.tensor([[0.5, 2.0, -1.0, 0.0, 1.0], [3.0, -2.0, 0.0, 1.0, 0.0]])
    c = Case("sample(logits, SamplingParams(temperature=0))", "greedy decoding of 2 sequences",
             shapes="logits [2, 5] -> (token_ids [2] int64, logprobs [2] float32)",
             hint="temperature 0 means greedy: return logits.argmax(-1) without dividing by 0",
             lesson=LESSON + "#greedy")
    ids, logprobs = c.call(impl.sample, logits, SamplingParams(temperature=0.0))
    c.equal(ids, torch.tensor([1, 0]))
    c.close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]],
            hint="the logprob is log_softmax(logits) at the chosen token")
    c = Case("sample(logits, SamplingParams(temperature=0, top_k=2, top_p=0.5))", "greedy with top-k and top-p set: "
             "the same tokens, and the same logprobs", shapes="logits [2, 5] -> (token_ids [2], logprobs [2])",
             hint="greedy takes the argmax, which every filter keeps; its logprob is still log_softmax of the RAW "
                  "logits (the docstring: before temperature and filtering), not of the filtered ones",
             lesson=LESSON + "#greedy")
    ids, logprobs = c.call(impl.sample, logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5))
    c.equal(ids, torch.tensor([1, 0]))
    c.close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_temperature_divides_the_logits(impl):
    c = Case("filter_logits([[2, 1, 0]], SamplingParams(temperature=2))", "temperature 2, no top-k, no top-p",
             shapes="logits [1, 3]", hint="logits / temperature: T > 1 flattens, T < 1 sharpens",
             lesson=LESSON + "#temperature")
    got = c.call(impl.filter_logits, torch.tensor([[2.0, 1.0, 0.0]]), SamplingParams(temperature=2.0))
    c.close(got, torch.tensor([[1.0, 0.5, 0.0]]))


def test_top_k_keeps_the_k_largest(impl):
    c = Case("filter_logits([[0.1, 3, 2, -1, 1]], SamplingParams(temperature=1, top_k=2))",
             "top-k with k = 2", shapes="logits [1, 5]", lesson=LESSON + "#top-k",
             hint="tokens below the k-th largest logit get -inf; the k largest keep their logit")
    got = c.call(impl.filter_logits, torch.tensor([[0.1, 3.0, 2.0, -1.0, 1.0]]),
                 SamplingParams(temperature=1.0, top_k=2))
    c.equal(got, torch.tensor([[-INF, 3.0, 2.0, -INF, -INF]]))


def test_top_p_keeps_the_token_that_crosses_p(impl):
    logits = logits_of([0.2, 0.5, 0.3])
    c = Case("filter_logits(logits, SamplingParams(temperature=1, top_p=0.7))",
             "probabilities [0.2, 0.5, 0.3] (unsorted); sorted: 0.5 (mass before 0), 0.3 (mass before 0.5 < 0.7: "
             "kept, crosses 0.7), 0.2 (mass before 0.8 >= 0.7: dropped)", shapes="logits [1, 3]",
             hint=TOP_P, lesson=LESSON + "#top-p")
    got = c.call(impl.filter_logits, logits, SamplingParams(temperature=1.0, top_p=0.7))
    c.close(got, torch.tensor([[-INF, logits[0, 1].item(), logits[0, 2].item()]]))


def test_top_p_below_the_top_probability_keeps_one_token(impl):
    logits = logits_of([0.1, 0.9])
    c = Case("filter_logits(logits, SamplingParams(temperature=1, top_p=0.5))",
             "probabilities [0.1, 0.9]: the most likely token alone exceeds top_p", shapes="logits [1, 2]",
             hint=TOP_P + " (never mask everything: softmax of all -inf is nan)", lesson=LESSON + "#top-p")
    got = c.call(impl.filter_logits, logits, SamplingParams(temperature=1.0, top_p=0.5))
    c.close(got, torch.tensor([[-INF, logits[0, 1].item()]]))


def test_top_p_ignores_a_shift_of_the_logits(impl):
    probs = [0.05, 0.4, 0.15, 0.25, 0.15]
    c = Case("filter_logits(logits + shift, SamplingParams(temperature=1, top_p=0.6))",
             "the same probabilities [0.05, 0.4, 0.15, 0.25, 0.15] from logits shifted by 0 and by 10",
             shapes="logits [1, 5]", hint=TOP_P + "; softmax ignores a shift, so the kept set must too",
             lesson=LESSON + "#top-p")
    params = SamplingParams(temperature=1.0, top_p=0.6)
    kept = [torch.isfinite(c.call(impl.filter_logits, logits_of(probs, shift), params)) for shift in (0.0, 10.0)]
    expected = torch.tensor([[False, True, False, True, False]])
    c.equal(kept[0], expected)
    c.equal(kept[1], expected)


def test_sampling_follows_the_tempered_distribution(impl):
    logits = torch.tensor([[1.0, 0.0, -1.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.5):
        expected = torch.softmax(logits[0] / temperature, -1)
        c = Case(f"sample(logits, SamplingParams(temperature={temperature}))",
                 f"4000 draws from logits [1, 0, -1]: frequencies vs softmax(logits / {temperature}) "
                 f"= {[round(p, 3) for p in expected.tolist()]}", shapes="logits [4000, 3] -> token_ids [4000]",
                 hint="probs = softmax(filter_logits(logits, params)); torch.multinomial(probs, 1, "
                      "generator=generator)", lesson=LESSON + "#temperature")
        ids, _ = c.call(impl.sample, logits, SamplingParams(temperature=temperature), g)
        freq = torch.bincount(ids, minlength=3).float() / len(ids)
        c.close(freq, expected, atol=0.04, rtol=0.0)


def test_logprob_is_the_models_not_the_filtered_one(impl):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    c = Case("sample(logits, SamplingParams(temperature=1, top_k=1))", "top-k 1: only the argmax can be drawn",
             shapes="logits [1, 4] -> (token_ids [1], logprobs [1])", lesson=LESSON + "#top-k",
             hint="the token is drawn from the filtered distribution, but its logprob is log_softmax of the "
                  "RAW logits (before temperature and filtering), as OpenAI-style APIs report it")
    ids, logprobs = c.call(impl.sample, logits, SamplingParams(temperature=1.0, top_k=1))
    c.equal(ids, torch.tensor([0]))
    c.close(logprobs, torch.log_softmax(logits, -1)[:, 0])


def test_same_seed_same_tokens(impl):
    logits = torch.zeros(1, 50)
    params = SamplingParams(temperature=1.0, seed=123)
    c = Case("sample(logits, params, generator) x 20, twice", "a flat distribution over 50 tokens, seed 123",
             shapes="logits [1, 50]", lesson=LESSON + "#seeds",
             hint="draw with torch.multinomial(..., generator=generator): the seeded generator makes runs repeat")
    runs = []
    for _ in range(2):
        g = params.make_generator("cpu")
        runs.append([c.call(impl.sample, logits, params, g)[0].item() for _ in range(20)])
    c.equal(runs[1], runs[0])
    c.true(len(set(runs[0])) > 1, "always the same token at temperature 1", expected="varied tokens",
           got=runs[0])


def test_temperature_comes_before_top_p(impl):
    logits = logits_of([0.7, 0.2, 0.1])
    c = Case("filter_logits(logits, SamplingParams(temperature=2, top_p=0.7))",
             "probabilities [0.7, 0.2, 0.1]; at T = 2 they flatten to [0.523, 0.280, 0.198], so the mass before "
             "the 2nd token is 0.523 < 0.7: two tokens are kept (top-p on the untempered 0.7 would keep one)",
             shapes="logits [1, 3]", lesson=LESSON + "#temperature",
             hint="order of operations (vLLM, Hugging Face): divide by the temperature FIRST, then top-k, then "
                  "top-p on the tempered probabilities; " + TOP_P)
    got = c.call(impl.filter_logits, logits, SamplingParams(temperature=2.0, top_p=0.7))
    c.close(got, torch.tensor([filter_row(logits[0].tolist(), 2.0, top_p=0.7)]))


def test_temperature_top_k_top_p_together_on_a_batch(impl):
    logits = torch.tensor([[1.0, 4.0, 2.5, -1.0, 3.0, 0.0], [40.0, 38.0, 39.5, 10.0, 20.0, 39.0]])
    cases = [(0.5, 3, 0.9), (1.5, 4, 0.8), (3.0, 0, 0.6)]
    for temperature, top_k, top_p in cases:
        c = Case(f"filter_logits(logits, SamplingParams(temperature={temperature}, top_k={top_k}, top_p={top_p}))",
                 "2 sequences whose logits have very different scales, every knob set at once",
                 shapes="logits [2, 6]: each row is filtered on its own", lesson=LESSON,
                 hint="logits / temperature, then per row: the top_k largest (the k-th largest OF THAT ROW: "
                      "topk(...).values[:, -1:]), then top-p on that row's softmax; " + TOP_P)
        got = c.call(impl.filter_logits, logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        expected = torch.tensor([filter_row(row, temperature, top_k, top_p) for row in logits.tolist()])
        c.close(got, expected)


def test_logprob_ignores_the_temperature(impl):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 2.0]])
    c = Case("sample(logits, SamplingParams(temperature=2.5, top_k=1))",
             "2 sequences, temperature 2.5, top-k 1: the argmax of each row is drawn",
             shapes="logits [2, 4] -> (token_ids [2], logprobs [2])", lesson=LESSON + "#temperature",
             hint="the logprob is log_softmax of the RAW logits (before temperature and filtering), as "
                  "OpenAI-style APIs report it; the temperature only changes how the token is drawn")
    ids, logprobs = c.call(impl.sample, logits, SamplingParams(temperature=2.5, top_k=1))
    c.equal(ids, torch.tensor([0, 1]))
    c.close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [0, 1]])


# -- issue 30: the whole documented domain, against minillm's filter_logits and sample -------------------------

REF = reference(EXERCISES["ex08"])
TEMPERATURES = [1e-5, 1e-3, 0.1, 0.5, 1.0, 1.7, 100.0, 1e6]
TOP_PS = [1.0, 1e-6, 0.3, 0.5, 0.9, 0.999]


def random_logits(seed: int, batch: int, vocab: int, ties: bool, step: float, n_minus_inf: int,
                  dtype=torch.float32) -> torch.Tensor:
    """[batch, vocab] logits from a seed: distinct values on a grid (or small integers, with ties), some -inf
    (never a whole row)."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(-3, 4, (batch, vocab), generator=g).float()
    else:
        logits = torch.stack([torch.randperm(vocab, generator=g).float() for _ in range(batch)]) * step - 3.0
    for row in logits:
        finite = torch.randperm(vocab, generator=g)[: min(n_minus_inf, vocab - 1)]
        row[finite] = -INF
    return logits.to(dtype)


def top_p_is_clear_of_the_boundary(logits: torch.Tensor, params: SamplingParams) -> bool:
    """False when some token's mass-before lies within 1e-4 of top_p: there rounding decides (the reference's
    cumsum against another correct sum order), which no docstring can promise."""
    if params.top_p >= 1:
        return True
    x = logits.double() / params.temperature
    if params.top_k:
        kth = torch.topk(x, min(params.top_k, x.shape[-1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -INF)
    probs = torch.softmax(x, dim=-1).sort(dim=-1, descending=True).values
    mass_before = probs.cumsum(-1) - probs
    return bool(((mass_before - params.top_p).abs() > 1e-4).all())


def draw_params(data, vocab: int, greedy_ok: bool = False) -> SamplingParams:
    temperature = data.draw(st.sampled_from(([0.0] if greedy_ok else []) + TEMPERATURES) |
                            st.floats(1e-5, 50.0), label="temperature")
    top_k = data.draw(st.sampled_from([0, 1, 2, vocab, vocab + 5]) | st.integers(0, vocab), label="top_k")
    top_p = data.draw(st.sampled_from(TOP_PS) | st.floats(0.01, 1.0), label="top_p")
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


@given(data=st.data())
@settings(CHECKS)
def test_filter_logits_agrees_with_the_reference(impl, data):
    vocab = data.draw(st.integers(1, 40), label="vocab")
    batch = data.draw(st.integers(1, 3), label="batch")
    params = draw_params(data, vocab)
    ties = params.top_p == 1 and data.draw(st.booleans(), label="tied logits")  # top-p on ties: the sort decides
    logits = random_logits(data.draw(st.integers(0, 9), label="seed"), batch, vocab, ties,
                           data.draw(st.sampled_from([0.01, 0.3, 1.0, 5.0]), label="spacing"),
                           data.draw(st.integers(0, 3), label="-inf per row"))
    assume(top_p_is_clear_of_the_boundary(logits, params))
    agree(impl.filter_logits, REF.filter_logits, lambda: ((logits.clone(), params), {}),
          what="filter_logits", exercise="ex08", lesson=LESSON,
          hint="logits / temperature; per row keep the top_k largest (all of those tied with the k-th; top_k above "
               "the vocabulary keeps all); then top-p on that row's softmax: " + TOP_P + "; -inf stays -inf; "
               "return a new tensor, never change the caller's logits")


@given(data=st.data())
@settings(CHECKS)
def test_sample_agrees_with_the_reference(impl, data):
    """Greedy and one-token distributions exactly; any other draw: the same types, a token the filter keeps,
    its logprob under the raw logits; bad logits (NaN, +inf, a row with no finite value): ValueError."""
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), label="dtype")
    vocab = data.draw(st.integers(1, 40), label="vocab")
    batch = data.draw(st.integers(1, 3), label="batch")
    params = draw_params(data, vocab, greedy_ok=True)
    scale = data.draw(st.sampled_from([1.0, 1.0, 1e4] + ([1e35] if dtype == torch.float32 else [])), label="scale")
    if scale == 1e35:  # what the shift is for: a small temperature on large logits overflows float32 without it
        params = SamplingParams(temperature=data.draw(st.sampled_from([1e-5, 1e-4]), label="small temperature"),
                                top_k=params.top_k, top_p=params.top_p)
    logits = random_logits(data.draw(st.integers(0, 9), label="seed"), batch, vocab, False, 0.3,
                           data.draw(st.integers(0, 3), label="-inf per row")) * scale
    bad = data.draw(st.sampled_from([None, None, None, "nan", "+inf", "all -inf"]), label="bad logits")
    if bad:
        row = data.draw(st.integers(0, batch - 1), label="bad row")
        logits[row] = -INF if bad == "all -inf" else logits[row]
        logits[row, data.draw(st.integers(0, vocab - 1), label="at")] = {"nan": float("nan"), "+inf": INF}.get(
            bad, -INF)
    logits = logits.to(dtype)
    seed = data.draw(st.integers(0, 2**16), label="generator seed")
    one_token = params.greedy or params.top_k == 1 or params.top_p == 1e-6  # exactly one token can come out

    def inputs():
        return (logits.clone(), params, torch.Generator().manual_seed(seed)), {}

    agree(impl.sample if one_token else _facts(impl.sample), REF.sample if one_token else _facts(REF.sample),
          inputs, what="sample" if one_token else "sample -> (facts about the draw)", exercise="ex08",
          lesson=LESSON, tol=(1e-5, 1e-5),
          hint="compute in float32 whatever the logits' dtype; ValueError when a row holds NaN or +inf or has no "
               "finite value (check before sampling: argmax of a NaN row picks the NaN); greedy below temperature "
               "1e-5 (argmax); else shift the row's max to 0, filter_logits, softmax, torch.multinomial(probs, 1, "
               "generator=generator); the logprob is log_softmax of the RAW logits at the chosen token; returns "
               "(token_ids [B] int64, logprobs [B] float32)")


def _facts(sample_fn):
    """A draw differs by the random stream; what must hold for any draw is compared instead."""
    def facts(logits, params, generator):
        ids, logprobs = sample_fn(logits, params, generator)
        raw = logits.float()
        kept = torch.isfinite(REF.filter_logits(raw - raw.amax(-1, keepdim=True), params))
        ok_ids = isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.shape == (raw.shape[0],)
        return {"token_ids": (type(ids).__name__, str(getattr(ids, "dtype", None)), list(getattr(ids, "shape", []))),
                "logprobs": (type(logprobs).__name__, str(getattr(logprobs, "dtype", None)),
                             list(getattr(logprobs, "shape", []))),
                "every token is one the filter keeps": ok_ids and bool(kept.gather(-1, ids[:, None]).all()),
                "logprob = log_softmax(raw logits)[token]": ok_ids and isinstance(logprobs, torch.Tensor) and bool(
                    torch.allclose(logprobs.float(), torch.log_softmax(raw, -1).gather(-1, ids[:, None])[:, 0],
                                   atol=1e-5, rtol=1e-5))}
    facts.__name__ = "sample"
    return facts


def test_a_small_temperature_on_large_logits(impl):
    logits = torch.tensor([[3e34, 1e34, 0.0]])
    c = Case("sample([[3e34, 1e34, 0]], SamplingParams(temperature=1e-5))", "large logits over a small temperature: "
             "3e34 / 1e-5 is beyond float32's 3.4e38 (inf, then NaN in the softmax); the answer is token 0",
             shapes="logits [1, 3] -> token_ids [1]", lesson=LESSON + "#temperature",
             hint="as the docstring of filter_logits says, shift each row so that its largest logit is 0 "
                  "(logits - logits.amax(-1, keepdim=True)) before dividing by the temperature: softmax ignores "
                  "the shift, and the others then go to -inf (probability 0), never +inf")
    ids, _ = c.call(impl.sample, logits, SamplingParams(temperature=1e-5), torch.Generator().manual_seed(0))
    c.equal(ids, torch.tensor([0]))


def test_bad_logits_are_refused(impl):
    nan, cases = float("nan"), []
    for temperature in (0.0, 1.0):
        cases += [([[1.0, nan, 0.5]], temperature, "a NaN logit"), ([[0.0, 1.0], [INF, 0.0]], temperature, "+inf"),
                  ([[0.0, 1.0], [-INF, -INF]], temperature, "a row with no finite value")]
    for rows, temperature, what in cases:
        c = Case(f"sample({rows}, SamplingParams(temperature={temperature}))", f"{what}: the docstring promises "
                 "ValueError (a broken model or mask), not a token", shapes=f"logits [{len(rows)}, {len(rows[0])}]",
                 lesson=LESSON, hint="check first: torch.isfinite(logits.float().amax(dim=-1)).all() is False for a "
                                     "row holding NaN or +inf or no finite value; raise ValueError then (greedy's "
                                     "argmax would silently pick the NaN)")
        c.raises(ValueError, impl.sample, torch.tensor(rows), SamplingParams(temperature=temperature),
                 torch.Generator().manual_seed(0))


def _draws(impl, seed: int, global_seed: int, n: int = 20) -> list[int]:
    """n tokens from a flat distribution over 50, the generator seeded with ``seed``, the global RNG with another."""
    logits, params = torch.zeros(1, 50), SamplingParams(temperature=1.0)
    with torch.random.fork_rng():
        torch.manual_seed(global_seed)
        g = torch.Generator().manual_seed(seed)
        return [int(impl.sample(logits, params, g)[0][0]) for _ in range(n)]


def test_the_generator_alone_decides_the_draws(impl):
    c = Case("sample(zeros(1, 50), SamplingParams(temperature=1), Generator().manual_seed(s)) x 20",
             "the same generator seed after torch.manual_seed(1) and after torch.manual_seed(2); then seeds 1 and 2",
             shapes="logits [1, 50]", lesson=LESSON + "#seeds",
             hint="draw only from the generator you are given (torch.multinomial(probs, 1, generator=generator)): "
                  "not from the global RNG (torch.manual_seed would change your tokens), not from a generator "
                  "of your own (every seed would give the same tokens)")
    first = c.call(_draws, impl, 7, 1)
    c.equal(c.call(_draws, impl, 7, 2), first, hint="the global RNG changed your tokens: " + c.hint)
    c.true(c.call(_draws, impl, 8, 1) != first, "generators seeded 7 and 8 drew the same 20 tokens",
           expected="different tokens", got=first)
