"""Speculative decoding (minillm/speculative.py) against plain decoding and the model's distribution.

Oracles: plain greedy generate (token for token), transformers' softmax on the same weights
(the sampled distribution, chi-square), teacher-forced decode_step (the KV cache), hand cases.
"""

import json
import re

import pytest
import torch

from minillm import (KVCache, PrefixCache, SamplingParams, Trace, decode_step, generate, load_model, load_tokenizer,
                     prefill)
from minillm.cli import main
from minillm.errors import CacheFullError
from minillm.phases import verify
from minillm.speculative import (Draft, NgramDraft, SpeculativeConfig, SpeculativeStats, accept_greedy,
                                 accept_or_resample)
from tiny_models import LLAMA_BASE, build_hf, save_hf

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8], [3, 3, 3, 3], [42]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on one thread: their products are too small to share, and on a busy machine
    two threads waiting for each other made these tests 50x slower (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _draft_like(hf_target, noise: float, seed: int):
    """A copy of the target with noisy weights: accepts often, rejects sometimes."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in hf_target.parameters():
            p.add_(noise * torch.randn_like(p))
    return hf_target


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Folders of (target, draft): tiny Llamas with a 128-token vocabulary."""
    root = tmp_path_factory.mktemp("spec")
    draft = _draft_like(build_hf("llama", LLAMA_BASE), noise=0.02, seed=1)
    return save_hf(build_hf("llama", LLAMA_BASE), root / "target"), save_hf(draft, root / "draft")


@pytest.fixture(scope="module")
def models(model_dirs):
    """(target, draft) in float32."""
    return tuple(load_model(d, device="cpu") for d in model_dirs)


def _config(method: str, k: int, draft) -> SpeculativeConfig:
    return SpeculativeConfig(method, k, draft_model=draft if method == "draft_model" else None)


# -- greedy: token for token plain greedy -------------------------------------------------------

@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_output_is_plain_greedy(models, method, k):
    target, draft = models
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        plain = [(s.token_id, s.cache_length, s.phase) for s in generate(target, prompt, params)]
        steps = list(generate(target, prompt, params, speculative=_config(method, k, draft)))
        assert [(s.token_id, s.cache_length, s.phase) for s in steps] == plain
        assert steps[-1].finish_reason == "length"
        assert sum(s.proposed for s in steps if s.proposed) > 0  # speculation really happened


@pytest.mark.parametrize("schedule", ["constant", "heuristic"])
def test_both_schedules_are_plain_greedy(models, schedule):
    target, draft = models
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for method in ("ngram", "draft_model"):
        spec = SpeculativeConfig(method, 4, num_speculative_tokens_schedule=schedule,
                                 draft_model=draft if method == "draft_model" else None)
        steps = list(generate(target, PROMPTS[0], params, speculative=spec))
        assert [s.token_id for s in steps] == [s.token_id for s in generate(target, PROMPTS[0], params)]
        if method == "draft_model":  # it always proposes k: each pass's k follows the schedule (or the room left)
            k = 4
            for step_index, step in enumerate(steps):
                if step.proposed is not None:
                    assert step.proposed == min(k, params.max_new_tokens - step_index - 1)
                    k = spec.next_k(k, step.proposed, step.accepted)


@pytest.mark.parametrize("schedule, k, proposed, accepted, expected", [
    ("heuristic", 3, 3, 3, 5),  # all kept: guess 2 further
    ("heuristic", 4, 4, 4, 5),  # ... up to num_speculative_tokens
    ("heuristic", 3, 3, 1, 2),  # some rejected: one fewer
    ("heuristic", 1, 1, 0, 1),  # ... never below 1
    ("heuristic", 3, 0, 0, 3),  # nothing proposed: unchanged
    ("constant", 2, 2, 2, 2),
    ("constant", 5, 5, 0, 5),
])
def test_schedule_moves_k(schedule, k, proposed, accepted, expected):
    config = SpeculativeConfig("ngram", 5, num_speculative_tokens_schedule=schedule)
    assert config.next_k(k, proposed, accepted) == expected


class UniformDraft(Draft):
    """A third draft, as a student would write one: k uniform guesses, q uniform."""

    def __init__(self, vocab: int, q_rows: int = 0):
        self.vocab, self.q_rows, self.gen = vocab, q_rows, torch.Generator().manual_seed(0)

    def propose(self, token_ids, k):
        self.k = k
        return torch.randint(self.vocab, (k,), generator=self.gen).tolist()

    def draft_probs(self):
        return torch.full((self.q_rows or self.k, self.vocab), 1 / self.vocab)


def test_a_custom_draft_keeps_greedy_output(models):
    target, _ = models
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = [s.token_id for s in generate(target, PROMPTS[1], params)]
    spec = SpeculativeConfig("custom", 3, draft=UniformDraft(128))
    assert [s.token_id for s in generate(target, PROMPTS[1], params, speculative=spec)] == plain


class SilentDraft(Draft):
    """A draft that never finds anything to propose (free-form text, to prompt lookup)."""

    def propose(self, token_ids, k):
        return []


@pytest.mark.compile
def test_a_round_with_nothing_drafted_runs_the_decode_paths_step(models):
    """On a decode path with a compiled step, a round without drafts is that step (it was the eager
    forward: x0.78 plain on free-form text where the compiled step ran x1.0), greedy output unchanged."""
    from minillm.fast.compile import compile_decode_step

    class CountingStep:  # the compiled step, its calls counted (decode_step asks it whether it applies)
        def __init__(self, step):
            self.step, self.applies = step, step.applies

        def __call__(self, *args):
            calls.append(1)
            return self.step(*args)

    target, _ = models
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = [s.token_id for s in generate(target, PROMPTS[1], params)]
    calls, before = [], target.compiled_decode
    target.compiled_decode = CountingStep(compile_decode_step())
    try:
        got = [s.token_id for s in generate(target, PROMPTS[1], params,
                                            speculative=SpeculativeConfig("custom", 3, draft=SilentDraft()))]
    finally:
        target.compiled_decode = before
    assert got == plain and len(calls) == 7  # every token after the prefill's


def test_continues_a_filled_cache_as_plain_generate_does(models):
    """generate(cache=...) with a prefix already in the cache: the prompt goes on after it."""
    target, draft = models
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    runs = []
    for speculative in (None, _config("ngram", 4, draft), _config("draft_model", 4, draft)):
        cache = KVCache.for_model(target, max_seq_len=64)
        prefill(target, PROMPTS[1], cache)
        steps = list(generate(target, PROMPTS[0], params, cache=cache, speculative=speculative))
        runs.append(([(s.token_id, s.cache_length) for s in steps], cache.length))
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_greedy_with_penalties_is_plain_greedy(models):
    """The target's p at draft i counts the drafts before it (presence, frequency, repetition)."""
    target, draft = models
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)
    for method in ("ngram", "draft_model"):
        plain = [s.token_id for s in generate(target, PROMPTS[0], params)]
        spec = [s.token_id for s in generate(target, PROMPTS[0], params, speculative=_config(method, 4, draft))]
        assert spec == plain


def test_logprobs_are_the_models(models):
    target, draft = models
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = [s.logprob for s in generate(target, PROMPTS[0], params)]
    spec = [s.logprob for s in generate(target, PROMPTS[0], params, speculative=_config("draft_model", 3, draft))]
    assert spec == pytest.approx(plain, abs=1e-5)


# -- sampling: exactly the target's distribution ------------------------------------------------

def test_rule_gives_p_for_any_q():
    """accept_or_resample alone: d ~ q, then the kept-or-resampled token is distributed as p (hand p, q)."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])
    gen = torch.Generator().manual_seed(0)
    n, counts = 8000, torch.zeros(4)
    for _ in range(n):
        d = torch.multinomial(q[0], 1, generator=gen).item()
        n_accepted, token = accept_or_resample(p, q, [d], gen)
        counts[d if n_accepted else token] += 1
        if n_accepted:
            assert 0 <= token < 4  # the bonus, from p[1]
        else:
            assert token in (0, 2)  # residual max(0, p - q) = [0.4, 0, 0.1, 0]: tokens 0 and 2 only
    assert _chi2_p_value(counts, p[0] * n) > 1e-3


def test_rule_bonus_and_one_hot_cases():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert accept_or_resample(p, None, [1, 2]) == (2, 0)  # all accepted: bonus from the last row
    assert accept_or_resample(p, None, [1, 0]) == (1, 2)  # second rejected: the argmax there
    assert accept_or_resample(p[:1], None, []) == (0, 1)  # no drafts: a plain decode step


@pytest.mark.parametrize("seed", range(4))
def test_greedy_rule_is_the_rule_with_one_hot_p(seed):
    """accept_greedy (argmax only) against accept_or_resample on p = one_hot(argmax), random drafts."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 5, generator=gen)
    best = logits.argmax(-1)
    for _ in range(20):
        drafts = torch.where(torch.rand(5, generator=gen) < 0.7, best[:5], torch.randint(5, (5,), generator=gen))
        p = torch.nn.functional.one_hot(best, 5).float()
        assert accept_greedy(logits, drafts.tolist()) == accept_or_resample(p, None, drafts.tolist())


def _chi2_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test; cells expected below 5 are pooled into one (the usual rule)."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    return torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2), stat / 2).item()


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """(hf target, target, draft): vocab 8, logits scaled x4 so the distributions are far from uniform."""
    root = tmp_path_factory.mktemp("vocab8")
    cfg = dict(LLAMA_BASE, vocab_size=8)
    hf = build_hf("llama", cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(4)
    target = load_model(save_hf(hf, root / "target"), device="cpu")
    draft = _draft_like(build_hf("llama", cfg, seed=0), noise=0.1, seed=2)
    with torch.no_grad():
        draft.lm_head.weight.mul_(4)
    return hf, target, load_model(save_hf(draft, root / "draft"), device="cpu")


@pytest.mark.parametrize("method, temperature, top_k", [("ngram", 1.0, 0), ("draft_model", 1.0, 0),
                                                        ("draft_model", 0.7, 3)])
def test_sampled_tokens_follow_the_models_distribution(small_vocab, method, temperature, top_k):
    """Over 600 seeds, token 2 (the verified draft or the resampled token, k=1) and token 3 (the
    bonus, or the next round's) follow transformers' p(t2, t3) = sum over t1 of p(t1) p(t2|t1) p(t3|t1,t2).
    Resampling from p instead of max(0, p - q) gives p-values of 9e-8 (ngram) and 1e-9 (draft
    model) on t2's marginal here (measured), so the test can fail. With temperature and top-k, both
    p and q are transformed; the oracle applies them by hand to transformers' logits."""
    hf, target, draft = small_vocab
    prompt = list(range(8)) * 2  # every token seen before: the ngram draft always proposes
    V, n = 8, 600
    with torch.no_grad():  # every continuation t1 t2 in one batch: [64, len(prompt) + 2]
        pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), pairs], dim=1)
        logits = hf(ids).logits.double() / temperature
        if top_k:  # keep the k largest of each row
            logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
    p1 = probs[0, len(prompt) - 1]  # [V]
    p2 = probs[::V, len(prompt)]  # [V (t1), V (t2)]
    p3 = probs[:, len(prompt) + 1].reshape(V, V, V)  # [t1, t2, t3]
    expected = torch.einsum("a,ab,abc->bc", p1, p2, p3) * n  # [t2, t3]
    counts, proposed, accepted = torch.zeros(V, V, dtype=torch.float64), 0, 0
    config = (SpeculativeConfig("ngram", 1, prompt_lookup_min=1) if method == "ngram"  # a 1-token match: t1 was
              else _config(method, 1, draft))                                         # seen, so always a draft
    for seed in range(n):
        params = SamplingParams(temperature=temperature, top_k=top_k, seed=seed, max_new_tokens=3, ignore_eos=True)
        steps = list(generate(target, prompt, params, speculative=config))
        counts[steps[1].token_id, steps[2].token_id] += 1
        proposed, accepted = proposed + steps[1].proposed, accepted + steps[1].accepted
    assert 50 < accepted < proposed - 50  # both accepts and rejections were exercised
    assert _chi2_p_value(counts.sum(1), expected.sum(1)) > 1e-3  # t2
    assert _chi2_p_value(counts.flatten(), expected.flatten()) > 1e-3  # (t2, t3)


# -- the KV cache equals plain decoding's ------------------------------------------------------

def test_verify_rows_are_the_decode_steps_of_the_same_tokens(models):
    """phases.verify over [last, d1, d2, d3]: row i is decode_step's logits after token i (teacher forcing),
    the cache grows by 4 and holds the same K/V; one token is exactly a decode step."""
    target, _ = models
    tokens = [9, 17, 4, 101]
    cache, plain = (KVCache.for_model(target, max_seq_len=16) for _ in range(2))
    prefill(target, PROMPTS[1], cache)
    prefill(target, PROMPTS[1], plain)
    rows = verify(target, tokens, cache)
    steps = torch.cat([decode_step(target, t, plain) for t in tokens])
    assert rows.shape == (4, 128) and rows.dtype == torch.float32 and cache.length == plain.length == 12
    torch.testing.assert_close(rows, steps, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.k[..., :12, :], plain.k[..., :12, :], atol=1e-5, rtol=0)
    cache.truncate(8)
    plain.truncate(8)
    assert torch.equal(verify(target, tokens[:1], cache), decode_step(target, tokens[0], plain))


@pytest.mark.parametrize("tokens, error, message", [
    ([], ValueError, "token_ids is empty"),
    ([5, 128], ValueError, r"token_ids must be in \[0, 128\) \(the vocabulary\)"),
    ([5, 6, 7, 8, 9], CacheFullError, r"KV cache full: 8 \+ 5 tokens > max_seq_len 12"),
])
def test_verify_refuses_what_prefill_refuses(models, tokens, error, message):
    target, _ = models
    cache = KVCache.for_model(target, max_seq_len=12)
    prefill(target, PROMPTS[1], cache)
    with pytest.raises(error, match=message):
        verify(target, tokens, cache)
    assert cache.length == 8


# float64 is not bit-exact: a (k+1)-row product rounds differently from a 1-row one (3e-16 measured)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("fast", [True, False])
def test_cache_equals_plain_decoding_of_the_same_tokens(model_dirs, dtype, tol, fast):
    """Sampled runs (each a different accept/reject pattern) vs the same tokens decoded one at a time,
    on the fast modules and on the plain ones."""
    target, draft = (load_model(d, device="cpu", dtype=dtype, fast=fast) for d in model_dirs)  # float64 too
    patterns = set()
    for seed in range(4):
        params = SamplingParams(temperature=1.5, seed=seed, max_new_tokens=20, ignore_eos=True)
        cache = KVCache.for_model(target, max_seq_len=64)
        steps = list(generate(target, PROMPTS[0], params, cache=cache, speculative=_config("draft_model", 3, draft)))
        patterns.add(tuple(s.accepted for s in steps if s.proposed))
        plain = KVCache.for_model(target, max_seq_len=64)
        prefill(target, PROMPTS[0], plain)
        for step in steps[:-1]:
            decode_step(target, step.token_id, plain)
        assert cache.length == plain.length == len(PROMPTS[0]) + len(steps) - 1
        n = plain.length
        torch.testing.assert_close(cache.k[..., :n, :], plain.k[..., :n, :], atol=tol, rtol=0)
        torch.testing.assert_close(cache.v[..., :n, :], plain.v[..., :n, :], atol=tol, rtol=0)
    assert len(patterns) > 1 and {0, 3} <= {a for p in patterns for a in p}  # rejections and full accepts


# -- stopping exactly where plain generate stops -----------------------------------------------

@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("stop", ["eos", "stop_id", "max_new_tokens", "cache", "context"])
def test_stops_where_plain_generate_stops(models, method, stop):
    """A draft proposing past EOS, a stop id, max_new_tokens, the cache or the model's context."""
    target, draft = models
    prompt = PROMPTS[0]
    free = [s.token_id for s in generate(target, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))]
    mid = free[len(free) // 2]  # a token the output reaches in mid-run
    kwargs, params = {}, SamplingParams(max_new_tokens=30, ignore_eos=True)
    if stop == "eos":
        kwargs["eos_token_ids"], params = [mid], SamplingParams(max_new_tokens=30)
    elif stop == "stop_id":
        params = SamplingParams(max_new_tokens=30, stop_token_ids=[mid])
    elif stop == "max_new_tokens":
        params = SamplingParams(max_new_tokens=7, ignore_eos=True)
    elif stop == "cache":
        kwargs["cache_size"] = len(prompt) + 11
    else:  # the model's 128 positions
        prompt = (prompt * 13)[:120]
    runs = []
    for speculative in (None, _config(method, 8, draft)):
        cache = KVCache.for_model(target, max_seq_len=kwargs.get("cache_size", 128))
        steps = list(generate(target, prompt, params, cache=cache, eos_token_ids=kwargs.get("eos_token_ids"),
                              speculative=speculative))
        runs.append(([s.token_id for s in steps], steps[-1].finish_reason, steps[-1].stop_reason, cache.length))
    assert runs[1] == runs[0]
    assert runs[0][1] == {"eos": "eos", "stop_id": "stop", "max_new_tokens": "length"}.get(stop, "cache_full")


def test_trace_shows_each_verification(models):
    target, draft = models
    trace = Trace()
    steps = list(generate(target, PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True), trace=trace,
                          speculative=_config("draft_model", 3, draft)))
    verifies, firsts = trace.of("verify"), [i for i, s in enumerate(steps) if s.proposed is not None]
    assert len(verifies) == len(firsts) and trace.prefill["n_tokens"] == len(PROMPTS[0])
    for event, first, end in zip(verifies, firsts, firsts[1:] + [len(steps)]):
        round_steps = steps[first:end]  # this pass's accepted drafts, then the model's own token
        assert (event["proposed"], event["accepted"]) == (round_steps[0].proposed, round_steps[0].accepted)
        assert event["drafted"][: event["accepted"]] == [s.token_id for s in round_steps[:-1]]
        assert event["token_id"] == round_steps[-1].token_id or end == len(steps)  # the last round may stop early
        assert event["cache_length_after"] == event["cache_length_before"] + 1 + event["accepted"]
        assert event["time_ms"] > 0
    assert {"resampled", "bonus"} <= {e["how"] for e in verifies}  # and "decode" when k is cut to 0 at the end
    stats = SpeculativeStats.from_steps(steps)
    assert trace.first("speculative")["acceptance_rate"] == stats.acceptance_rate
    assert trace.first("speculative")["mean_acceptance_length"] == stats.mean_acceptance_length
    from minillm.views.html import trace_html

    assert "<" in trace_html(trace) and "prefill=1" in repr(trace)


def test_trace_renders_each_verification(models):
    """The verify panel: a line per pass with its kept/proposed, token and cache lengths; rejected drafts marked."""
    from rich.console import Console

    from minillm.views.terminal import REJECTED, verify_panel

    target, draft = models
    trace = Trace()
    list(generate(target, PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True), trace=trace,
                  speculative=_config("draft_model", 3, draft)))
    console = Console(width=80, no_color=True, record=True, file=open("/dev/null", "w"))
    console.print(verify_panel(trace))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    rows = [line.split() for line in text.splitlines() if re.match(r"^│\s+\d+\s+\d+\s+\d+/\d+", line)]
    events = trace.of("verify")
    assert [row[1:6] for row in rows] == [
        [str(n), str(e["position"]), f"{e['accepted']}/{e['proposed']}", "id", str(e["token_id"])]
        for n, e in enumerate(events, start=1)]
    for row, e in zip(rows, events):
        cache = f"{e['cache_length_before']}->{e['cache_length_verified']}->{e['cache_length_after']}"
        assert row[6:8] == [e["how"], cache]
    assert text.count(REJECTED) == sum(e["proposed"] - e["accepted"] for e in events) > 0
    stats = trace.first("speculative")
    assert f"acceptance {100 * stats['acceptance_rate']:.1f}%" in text


# -- the drafts ------------------------------------------------------------------------------

@pytest.mark.parametrize("ids, k, lookup, proposal", [
    ([1, 2, 3, 9, 1, 2], 2, (1, 3), [3, 9]),
    ([1, 2, 7, 1, 2, 8, 1, 2], 2, (1, 3), [8, 1]),  # the latest earlier occurrence of [1, 2]
    ([4, 5, 6, 1, 5, 6], 5, (1, 3), [1, 5, 6]),  # fewer than k tokens follow
    ([7, 1, 9, 2, 1], 3, (1, 3), [9, 2, 1]),  # only a 1-gram matches
    ([7, 1, 9, 2, 1], 3, (2, 3), []),  # ... which prompt_lookup_min=2 refuses
    ([1, 2, 3], 3, (1, 3), []),
    ([3, 1, 2, 3, 4, 2, 3], 2, (1, 3), [4, 2]),  # [4, 2, 3] unseen; [2, 3] at 2 (the 1-gram [3] is never tried)
])
def test_ngram_draft_proposes_what_followed(ids, k, lookup, proposal):
    assert NgramDraft(*lookup).propose(ids, k) == proposal


def test_stats_from_steps(models):
    target, _ = models
    steps = list(generate(target, PROMPTS[2], SamplingParams(max_new_tokens=24, ignore_eos=True),
                          speculative=SpeculativeConfig("ngram", 4)))
    rounds = [s for s in steps if s.proposed]
    stats = SpeculativeStats.from_steps(steps)
    assert stats.num_draft_tokens == sum(s.proposed for s in rounds) > 0
    assert stats.acceptance_rate == sum(s.accepted for s in rounds) / stats.num_draft_tokens
    # every step is a token: one from the prefill, then per pass its accepted drafts + 1
    passes = sum(1 for s in steps if s.proposed is not None)
    assert len(steps) == 1 + passes + stats.num_accepted_tokens
    assert stats.mean_acceptance_length == 1 + stats.num_accepted_tokens / len(rounds)


# -- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
    (dict(num_speculative_tokens=2.0), "num_speculative_tokens must be an integer >= 1"),
    (dict(method="medusa"), "must be one of ngram, draft_model"),
    (dict(num_speculative_tokens_schedule="dynamic"), "num_speculative_tokens_schedule must be one of heuristic, "
                                                      "constant, got 'dynamic'"),
    (dict(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    (dict(method="draft_model"), "needs draft_model=<a loaded Transformer>"),
    (dict(draft_model="gpt2", method="draft_model"), "must be a minillm Transformer"),
    (dict(method="custom"), "method='custom' needs draft=<an instance of a Draft subclass>"),
    (dict(draft=NgramDraft()), "method='custom' needs draft="),
])
def test_bad_config_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        SpeculativeConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_bad_use_is_one_line(models, tmp_path):
    target, _ = models
    other = load_model(save_hf(build_hf("llama", dict(LLAMA_BASE, vocab_size=64)), tmp_path / "v64"), device="cpu")
    params = SamplingParams(max_new_tokens=4)
    cases = [
        (dict(speculative=SpeculativeConfig("draft_model", 2, draft_model=other)), "vocabulary has 64 tokens"),
        (dict(speculative=SpeculativeConfig(), cache=KVCache.for_model(target, batch_size=2, max_seq_len=32)),
         "runs one sequence, got a KV cache for batch 2"),
        (dict(speculative=SpeculativeConfig(), prefix_cache=PrefixCache(target)), "does not take a prefix_cache"),
        (dict(speculative={"method": "ngram"}), "must be a SpeculativeConfig"),
        (dict(speculative=SpeculativeConfig("custom", 3, draft=UniformDraft(128, q_rows=1))),  # k=2: 4 tokens at most
         re.escape("draft_probs() must be [n_proposed, vocab] = [2, 128] (a row per proposed token), got [1, 128]")),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            list(generate(target, PROMPTS[0], params, **kwargs))
        assert "\n" not in str(e.value)


# -- the real model: an input-grounded prompt --------------------------------------------------

REPEAT = ("Repeat exactly: The quick brown fox jumps over the lazy dog. It was a bright cold day in April, "
          "and the clocks were striking thirteen.")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """(model, tokenizer, chat prompt ids of REPEAT, eos ids as the CLI uses them)."""
    model, tok = load_model(smollm2_dir, device="cpu"), load_tokenizer(smollm2_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": REPEAT}]), add_special_tokens=False)
    return model, tok, ids, tok.eos_token_ids | set(model.generation_config.eos_token_ids)


@pytest.fixture(scope="module")
def smollm2_runs(smollm2):
    """Plain and ngram (k=5) greedy runs of REPEAT, 40 tokens at most: their steps."""
    model, tok, ids, eos = smollm2
    params = SamplingParams(max_new_tokens=40)
    return [list(generate(model, ids, params, eos_token_ids=eos, tokenizer=tok, speculative=spec))
            for spec in (None, SpeculativeConfig("ngram", 5))]


def test_smollm2_ngram_is_plain_greedy_in_fewer_passes(smollm2_runs):
    plain, spec = smollm2_runs
    assert [s.token_id for s in spec] == [s.token_id for s in plain]
    assert [s.text for s in spec] == [s.text for s in plain]
    assert spec[-1].finish_reason == plain[-1].finish_reason
    passes = 1 + sum(1 for s in spec if s.proposed is not None)
    assert passes <= len(spec) / 2  # the model read its weights at most once per 2 tokens


def test_smollm2_stop_string_inside_a_round(smollm2):
    model, tok, ids, eos = smollm2
    params = SamplingParams(max_new_tokens=40, stop=["lazy dog"])
    runs = [list(generate(model, ids, params, eos_token_ids=eos, tokenizer=tok, speculative=spec))
            for spec in (None, SpeculativeConfig("ngram", 5))]
    assert ["".join(s.text for s in run) for run in runs] == ["The quick brown fox jumps over the "] * 2
    assert [(run[-1].finish_reason, run[-1].stop_reason, len(run)) for run in runs[1:]] == \
        [(runs[0][-1].finish_reason, "lazy dog", len(runs[0]))]


def test_cli_speculative_prints_the_answer_and_the_acceptance(smollm2_runs, capsys):
    """In-process (the model loads in 2 s, not a subprocess's 20 on a busy machine)."""
    plain, spec = smollm2_runs
    code = main(["generate", "--speculative", "ngram", "--num-speculative-tokens", "5", "--max-new-tokens", "40",
                 REPEAT])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == "".join(s.text for s in plain) + "\n"
    stats, passes = SpeculativeStats.from_steps(spec), 1 + sum(1 for s in spec if s.proposed is not None)
    assert err.splitlines()[-1] == (
        f"[speculative ngram k=5 | accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafted "
        f"({100 * stats.acceptance_rate:.1f}%) | mean acceptance length {stats.mean_acceptance_length:.2f} | "
        f"{len(spec)} tok in {passes} passes of the model]")


def test_cli_speculative_trace_shows_the_passes(smollm2_runs, capsys):
    plain, spec = smollm2_runs
    code = main(["generate", "--speculative", "ngram", "--max-new-tokens", "40", "--trace", "steps",
                 "--prompt-lookup-min", "2", "--prompt-lookup-max", "3", REPEAT])  # the defaults, as flags
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == "".join(s.text for s in plain) + "\n"
    passes = 1 + sum(1 for s in spec if s.proposed is not None)
    assert f"Verification passes: {passes - 1} (speculative decoding)" in err  # the prefill is the first pass
    assert err.count("drafted: ") == sum(1 for s in spec if s.proposed)  # a list of drafts per pass that had some
    assert "' fox'  ' jumps'" in err and "bonus" in err
    assert err.splitlines()[-1].startswith("[speculative ngram k=5 | accepted ")


@pytest.mark.parametrize("args, message", [
    (["--speculative", "ngram", "--prefix-cache"], "--speculative does not go with --prefix-cache"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1, got 0"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens, --draft-model and --prompt-lookup-min/max need"),
    (["--prompt-lookup-min", "1"], "--num-speculative-tokens, --draft-model and --prompt-lookup-min/max need"),
    (["--speculative", "draft_model", "--draft-model", "x", "--prompt-lookup-max", "4"],
     "--prompt-lookup-min/max are for --speculative ngram"),
    (["--speculative", "ngram", "--prompt-lookup-min", "4"], "--prompt-lookup-min (4) must be <= --prompt-lookup-max (3)"),
    (["--speculative", "ngram", "--prompt-lookup-max", "0"], "--prompt-lookup-max must be an integer >= 1, got 0"),
    (["--speculative", "draft_model"], "--speculative draft_model needs --draft-model MODEL"),
    (["--speculative", "ngram", "--draft-model", "x"], "--speculative draft_model needs --draft-model MODEL"),
])
def test_cli_speculative_usage_errors(args, message, capsys):
    assert main(["generate", *args, "hi"]) == 2  # said before the model loads
    err = capsys.readouterr().err
    assert err == f"minillm: error: {message}" + err.split(message, 1)[1] and err.count("\n") == 1


def test_cli_speculative_json_carries_the_counts(smollm2_runs, capsys):
    plain, spec = smollm2_runs
    code = main(["generate", "--speculative", "ngram", "--max-new-tokens", "40", "--json", REPEAT])
    out, err = capsys.readouterr()
    assert code == 0, err
    record, stats = json.loads(out), SpeculativeStats.from_steps(spec)
    assert record["text"] == "".join(s.text for s in plain)
    assert record["speculative"] == {
        "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens, "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length}
    assert stats.num_accepted_tokens > 0  # the repeat prompt: prompt lookup finds its copies
