"""Exercise 8: sampling: greedy, temperature, top-k and top-p (nucleus)."""

import pytest
import torch

from exercises.checking import Case
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
