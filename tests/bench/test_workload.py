"""The load generator: arrivals against the gamma/exponential formulas, length bounds,
seeded determinism and the JSONL reader's errors."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from minillm.bench.workload import (
    LengthDistribution,
    WorkloadRequest,
    describe,
    load_jsonl,
    make_workload,
    parse_lengths,
    poisson_arrivals,
    safe_token_ids,
)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrival_gaps_have_the_gamma_mean_and_spread(burstiness):
    # gaps ~ Gamma(k=burstiness, scale=1/(rate·k)): mean 1/rate, coefficient of variation 1/sqrt(k)
    # (k = 1: exponential, a Poisson process, CV 1). Bounds: 5 standard errors of the sample mean.
    n, rate = 20_000, 4.0
    t = np.array(poisson_arrivals(n, rate, seed=1, burstiness=burstiness))
    gaps = np.diff(t)
    mean, cv = 1 / rate, 1 / math.sqrt(burstiness)
    assert t[0] == 0.0 and len(t) == n
    assert np.all(gaps >= 0)
    assert abs(gaps.mean() - mean) < 5 * mean * cv / math.sqrt(n - 1)
    assert abs(gaps.std() / gaps.mean() - cv) < 0.05 * cv


def test_arrivals_are_deterministic_for_a_seed():
    assert poisson_arrivals(50, 2.0, seed=7) == poisson_arrivals(50, 2.0, seed=7)
    assert poisson_arrivals(50, 2.0, seed=7) != poisson_arrivals(50, 2.0, seed=8)


@pytest.mark.parametrize("rate", [None, math.inf])
def test_offline_arrivals_are_all_at_zero(rate):
    assert poisson_arrivals(5, rate, seed=3) == [0.0] * 5


@pytest.mark.parametrize("kwargs", [dict(n=-1, rate_per_s=1.0), dict(n=3, rate_per_s=0.0),
                                    dict(n=3, rate_per_s=1.0, burstiness=0.0)])
def test_arrival_arguments_are_checked(kwargs):
    with pytest.raises(ValueError):
        poisson_arrivals(**kwargs)


@pytest.mark.parametrize("spec, low, high", [
    ("128", 128, 128),
    ("fixed:7", 7, 7),
    ("uniform:3-9", 3, 9),
    ("random:10,0.25", math.floor(10 * 0.75), math.ceil(10 * 1.25)),  # [7, 13]
    ("random:3,0.9", 1, math.ceil(3 * 1.9)),  # floor(0.3) = 0, raised to 1 token
])
def test_uniform_lengths_cover_exactly_their_bounds(spec, low, high):
    dist = parse_lengths(spec)
    drawn = dist.sample(5000, np.random.default_rng(0))
    assert (dist.low, dist.high) == (low, high)
    assert min(drawn) == low and max(drawn) == high  # both ends reached, nothing outside


def test_normal_lengths_are_rounded_clipped_and_centred():
    dist = parse_lengths("normal:20,10")
    drawn = np.array(dist.sample(20_000, np.random.default_rng(0)))
    assert drawn.dtype.kind == "i" and drawn.min() == 1  # P(N(20,10²) < 1) ≈ 3%: the clip is hit
    assert abs(drawn.mean() - 20) < 0.5  # clipping shifts the mean up by ~0.1


@pytest.mark.parametrize("spec", ["", "0", "fixed:-3", "uniform:9-3", "uniform:3", "random:256,1.0",
                                  "random:256", "normal:256", "normal:256,-1", "poisson:3", "1.5", "fixed:abc"])
def test_bad_length_specs_name_the_accepted_forms(spec):
    with pytest.raises(ValueError, match="uniform:LO-HI") as err:
        parse_lengths(spec)
    assert "\n" not in str(err.value)


def test_make_workload_respects_lengths_and_id_range():
    w = make_workload(200, "uniform:4-8", "fixed:5", rate=10.0, seed=1, low=3, high=10)
    assert len(w) == 200
    assert all(4 <= len(r.prompt_ids) <= 8 and r.max_tokens == 5 for r in w)
    assert {i for r in w for i in r.prompt_ids} == set(range(3, 10))  # 1200 draws hit all 7 ids
    assert [r.arrival_s for r in w] == poisson_arrivals(200, 10.0, np.random.SeedSequence(1).spawn(2)[1])


def test_make_workload_is_deterministic_and_prompts_do_not_depend_on_the_rate():
    a = make_workload(20, "uniform:1-50", "uniform:1-20", rate=2.0, seed=5, vocab_size=100)
    b = make_workload(20, "uniform:1-50", "uniform:1-20", rate=2.0, seed=5, vocab_size=100)
    c = make_workload(20, "uniform:1-50", "uniform:1-20", rate=None, seed=5, vocab_size=100)
    d = make_workload(20, "uniform:1-50", "uniform:1-20", rate=2.0, seed=6, vocab_size=100)
    assert a == b
    assert [(r.prompt_ids, r.max_tokens) for r in a] == [(r.prompt_ids, r.max_tokens) for r in c]
    assert all(r.arrival_s == 0.0 for r in c)
    assert a != d


def test_token_ids_and_shared_prefix():
    tok = SimpleNamespace(vocab_size=10, special_ids=frozenset({0, 1}), eos_token_ids={9}, bos_token_id=1)
    allowed = safe_token_ids(tok)
    assert allowed == [2, 3, 4, 5, 6, 7, 8]
    w = make_workload(30, "fixed:6", "fixed:1", seed=2, token_ids=allowed, shared_prefix_len=4)
    assert all(len(r.prompt_ids) == 4 + 6 for r in w)
    assert len({r.prompt_ids[:4] for r in w}) == 1  # the same prefix everywhere
    assert {i for r in w for i in r.prompt_ids} <= set(allowed)


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "vocab_size, high or token_ids"),
    (dict(low=5, high=5), "empty"),
    (dict(token_ids=[]), "token_ids is empty"),
])
def test_make_workload_needs_a_token_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_workload(3, "fixed:2", "fixed:2", **kwargs)


def test_workload_request_is_checked():
    with pytest.raises(ValueError, match="max_tokens"):
        WorkloadRequest(0.0, (1,), 0)
    with pytest.raises(ValueError, match="prompt_ids"):
        WorkloadRequest(0.0, (), 3)
    with pytest.raises(ValueError, match="arrival_s"):
        WorkloadRequest(-1.0, (1,), 3)


class CharTokenizer:
    """One id per character: ord(c)."""

    def encode(self, text):
        return [ord(c) for c in text]


def write_lines(tmp_path, lines):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl_reads_prompts_and_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": "hi", "max_tokens": 3}), "",
                                  json.dumps({"prompt": "abc", "max_tokens": 1, "extra": True})])
    w = load_jsonl(path, CharTokenizer(), rate=5.0, seed=4)
    assert [(r.prompt_ids, r.max_tokens) for r in w] == [((104, 105), 3), ((97, 98, 99), 1)]
    assert [r.arrival_s for r in w] == poisson_arrivals(2, 5.0, 4)


@pytest.mark.parametrize("bad, match", [
    ('{"prompt": "x", "max_tokens": ', "not valid JSON"),
    ('["x", 3]', "expected an object"),
    ('{"max_tokens": 3}', "missing key 'prompt'"),
    ('{"prompt": "x"}', "missing key 'max_tokens'"),
    ('{"prompt": "", "max_tokens": 3}', "non-empty string"),
    ('{"prompt": 5, "max_tokens": 3}', "non-empty string"),
    ('{"prompt": "x", "max_tokens": 0}', "integer >= 1"),
    ('{"prompt": "x", "max_tokens": 2.5}', "integer >= 1"),
    ('{"prompt": "x", "max_tokens": true}', "integer >= 1"),
])
def test_load_jsonl_errors_name_the_line(tmp_path, bad, match):
    path = write_lines(tmp_path, ['{"prompt": "ok", "max_tokens": 2}', "", bad])
    with pytest.raises(ValueError, match=match) as err:
        load_jsonl(path, CharTokenizer())
    assert str(err.value).startswith(f"{path}:3: ") and "\n" not in str(err.value)


def test_load_jsonl_of_an_empty_file(tmp_path):
    with pytest.raises(ValueError, match="no requests"):
        load_jsonl(write_lines(tmp_path, ["", "  "]), CharTokenizer())


def test_describe_by_hand():
    w = [WorkloadRequest(0.0, (1, 2), 4), WorkloadRequest(1.0, (1,), 6), WorkloadRequest(4.0, (1, 2, 3), 2)]
    d = describe(w)
    assert d["n_requests"] == 3
    assert d["arrival_span_s"] == 4.0 and d["arrival_rate_req_s"] == (3 - 1) / 4.0
    assert (d["prompt_len_min"], d["prompt_len_mean"], d["prompt_len_max"]) == (1, (2 + 1 + 3) / 3, 3)
    assert (d["max_tokens_min"], d["max_tokens_mean"], d["max_tokens_max"]) == (2, (4 + 6 + 2) / 3, 6)
    assert (d["total_prompt_tokens"], d["total_max_tokens"], d["total_tokens"]) == (6, 12, 18)
    assert describe([WorkloadRequest(0.0, (1,), 1)] * 2)["arrival_rate_req_s"] == math.inf
    with pytest.raises(ValueError, match="empty workload"):
        describe([])


def test_a_length_distribution_can_be_passed_directly():
    dist = LengthDistribution("mine", 2, 2)
    assert all(len(r.prompt_ids) == 2 for r in make_workload(4, dist, dist, vocab_size=5))
