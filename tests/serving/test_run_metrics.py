"""Run metrics on a hand-built run of four requests, every expected number computed
by hand in the comments (numpy's linear percentile: rank p/100·(n-1) between sorted values)."""

import dataclasses
from types import SimpleNamespace

import pytest

from minillm.metrics import RequestMetrics
from minillm.serving.run_metrics import (
    RunSummary,
    ServingRequestMetrics,
    request_metrics,
    span_s,
    summarize_run,
)


def req(arrival, scheduled, tokens, n_prompt, finish="stop", **extra):
    return SimpleNamespace(arrival_s=arrival, first_scheduled_s=scheduled, token_times_s=tokens,
                           num_prompt_tokens=n_prompt, finish_reason=finish, **extra)


def run():
    """   arrival sched  tokens                    ttft  e2e  tpot        itl           queue
    r0    10.0    10.1   10.5 10.7 10.9            500   900  400/2=200   200 200       100
    r1    10.2    10.2   10.6                      400   400  -           -             0
    r2    10.4    10.6   11.0 11.1 11.2 11.3       600   900  300/3=100   100 100 100   200
    r3    10.5    -      - (aborted, 2 preemptions)
    """
    return [
        req(10.0, 10.1, [10.5, 10.7, 10.9], 4),
        req(10.2, 10.2, [10.6], 6, finish="length"),
        req(10.4, 10.6, [11.0, 11.1, 11.2, 11.3], 2, num_preemptions=1, num_cached_tokens=2),
        req(10.5, None, [], 5, finish="abort", num_preemptions=2),
    ]


def test_request_metrics_start_at_arrival_and_add_the_queue():
    m = request_metrics(run()[2])
    assert isinstance(m, ServingRequestMetrics) and isinstance(m, RequestMetrics)
    assert m.ttft_ms == pytest.approx(600) and m.e2e_ms == pytest.approx(900)
    assert m.tpot_ms == pytest.approx(100) and m.queue_ms == pytest.approx(200)
    assert (m.num_preemptions, m.num_cached_tokens, m.n_prompt_tokens, m.n_output_tokens) == (1, 2, 2, 4)
    assert request_metrics(run()[0]).num_preemptions == 0  # absent attribute: 0


def test_run_summary_by_hand():
    s = summarize_run(run(), duration_s=2.0, ttft_slo_ms=550, tpot_slo_ms=150)
    assert (s.n_requests, s.n_completed, s.n_aborted) == (4, 3, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (4 + 6 + 2, 3 + 1 + 4)
    assert s.total_cached_tokens == 2 and s.n_preemptions == 1 + 2
    assert s.request_throughput_req_s == pytest.approx(3 / 2.0)
    assert s.output_throughput_tok_s == pytest.approx(8 / 2.0)
    assert s.total_token_throughput_tok_s == pytest.approx((12 + 8) / 2.0)
    expected = {
        # ttft [400, 500, 600]: p90 rank 1.8 -> 500 + 0.8·100; p99 rank 1.98
        "ttft_ms": (500, 500, 580, 598),
        # tpot [100, 200] (r1 has none): p50 rank 0.5, p90 rank 0.9
        "tpot_ms": (150, 150, 190, 199),
        # itl pooled [100, 100, 100, 200, 200]: mean 700/5; p90 rank 3.6 -> 200
        "itl_ms": (140, 100, 200, 200),
        # e2e [400, 900, 900]: p90 rank 1.8 between 900 and 900
        "e2e_ms": ((400 + 900 + 900) / 3, 900, 900, 900),
        # queue [0, 100, 200]: p90 rank 1.8 -> 100 + 0.8·100
        "queue_ms": (100, 100, 180, 198),
    }
    for name, stats in expected.items():
        got = [getattr(s, f"{stat}_{name}") for stat in ("mean", "p50", "p90", "p99")]
        assert got == pytest.approx(stats), name
    # SLOs TTFT <= 550, TPOT <= 150: r0 fails TPOT (200), r1 meets both (no TPOT), r2 fails TTFT (600),
    # r3 was aborted (a miss): 1 of 4 requests
    assert s.slo_attainment == pytest.approx(1 / 4)
    assert s.goodput_req_s == pytest.approx(1 / 2.0)


def test_to_dict_is_flat_with_vllm_names():
    d = summarize_run(run(), duration_s=2.0).to_dict()
    assert d["mean_ttft_ms"] == pytest.approx(500) and d["p99_itl_ms"] == pytest.approx(200)
    assert set(d) == {f.name for f in dataclasses.fields(RunSummary)}
    assert all(not isinstance(v, (dict, list, tuple)) for v in d.values())
    assert d["slo_attainment"] is None and d["goodput_req_s"] is None  # no SLO given


def test_one_token_requests_have_no_tpot_and_aborted_runs_have_no_latencies():
    s = summarize_run([run()[1]], duration_s=1.0)
    assert s.mean_tpot_ms is None and s.p99_itl_ms is None and s.mean_ttft_ms == pytest.approx(400)
    s = summarize_run([run()[3]], duration_s=1.0, ttft_slo_ms=100)
    assert (s.n_completed, s.n_aborted, s.mean_e2e_ms, s.request_throughput_req_s) == (0, 1, None, 0.0)
    assert s.slo_attainment == 0.0 and s.goodput_req_s == 0.0


@pytest.mark.parametrize("requests, duration, match", [
    ([], 1.0, "no requests"),
    (run(), 0.0, "duration_s must be > 0"),
    (run(), -1.0, "duration_s must be > 0"),
    ([req(1.0, 1.0, [], 3)], 1.0, r"request 0 .*no output token|request 0 .*token_times_s is empty"),
    ([req(1.0, 0.5, [2.0], 3)], 1.0, "before arrival_s"),
    ([req(1.0, None, [2.0], 3)], 1.0, "never ran"),
])
def test_errors(requests, duration, match):
    with pytest.raises(ValueError, match=match):
        summarize_run(requests, duration)


def test_span_is_first_arrival_to_last_token():
    assert span_s(run()) == pytest.approx(11.3 - 10.0)
    with pytest.raises(ValueError):
        span_s([run()[3]])
