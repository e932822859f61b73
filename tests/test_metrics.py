"""Request metrics from synthetic timestamps, computed by hand, and their invariants."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.metrics import RequestMetrics, percentile, slo_attainment, summarize


def test_hand_computed_request():
    m = RequestMetrics.from_timestamps(0.0, [0.5, 0.6, 0.8, 0.9], n_prompt_tokens=100)
    assert m.n_output_tokens == 4
    assert m.ttft_ms == pytest.approx(500)
    assert m.e2e_ms == pytest.approx(900)
    assert m.tpot_ms == pytest.approx(400 / 3)  # 133.33 ms
    assert m.itl_ms == pytest.approx((100, 200, 100))
    assert m.itl_p50_ms == pytest.approx(100)
    assert m.itl_p90_ms == pytest.approx(180)  # numpy linear: 100 + 0.8·(200 - 100)
    assert m.output_throughput_tok_s == pytest.approx(4 / 0.9)
    assert m.prefill_throughput_tok_s == pytest.approx(200)  # 100 tokens in 0.5 s
    assert m.mbu is None


def test_single_token_has_no_tpot():
    m = RequestMetrics.from_timestamps(10.0, [10.25], n_prompt_tokens=8)
    assert (m.ttft_ms, m.e2e_ms) == (pytest.approx(250), pytest.approx(250))
    assert m.tpot_ms is None and m.itl_ms == () and m.itl_p99_ms is None
    assert m.mbu is None


def test_mbu_by_hand():
    # 1 GB per step every 10 ms is 100 GB/s; on a 200 GB/s device that is 50%.
    m = RequestMetrics.from_timestamps(0.0, [0.1, 0.11, 0.12], 1, bytes_per_decode_step=1e9, peak_bandwidth=200e9)
    assert m.mbu == pytest.approx(0.5)


@pytest.mark.parametrize("times", [[], [-1.0], [0.5, 0.4]])
def test_bad_timestamps_raise(times):
    with pytest.raises(ValueError):
        RequestMetrics.from_timestamps(0.0, times, 1)


@given(
    start=st.floats(0, 1e4, allow_nan=False),
    gaps=st.lists(st.floats(1e-4, 10.0, allow_nan=False), min_size=2, max_size=50),
)
def test_e2e_is_ttft_plus_tpot_times_remaining_tokens(start, gaps):
    times = [start]
    for gap in gaps:
        times.append(times[-1] + gap)
    m = RequestMetrics.from_timestamps(start, times[1:], n_prompt_tokens=3)
    n = m.n_output_tokens
    assert m.e2e_ms == pytest.approx(m.ttft_ms + m.tpot_ms * (n - 1), rel=1e-9, abs=1e-6)
    assert m.tpot_ms == pytest.approx(sum(m.itl_ms) / len(m.itl_ms), rel=1e-9, abs=1e-6)
    assert len(m.itl_ms) == n - 1


def test_percentile_values():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)  # 1 + 0.99·99
    assert percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def _requests():
    """Four requests: TTFT 100, 200, 300, 2000 ms; TPOT 10, 20, 50 ms and one single-token request."""
    return [
        RequestMetrics.from_timestamps(0.0, [0.1, 0.11, 0.12], 10),
        RequestMetrics.from_timestamps(0.0, [0.2, 0.22], 20),
        RequestMetrics.from_timestamps(0.0, [0.3, 0.35, 0.40], 30),
        RequestMetrics.from_timestamps(0.0, [2.0], 40),
    ]


def test_summarize():
    s = summarize(_requests())
    assert s["n_requests"] == 4
    assert s["total_input_tokens"] == 100 and s["total_output_tokens"] == 9
    assert s["p50_ttft_ms"] == pytest.approx(250)
    assert s["mean_ttft_ms"] == pytest.approx(650)
    assert s["p50_tpot_ms"] == pytest.approx(20)  # the single-token request has no TPOT
    assert s["p90_tpot_ms"] == pytest.approx(44)  # 20 + 0.8·(50 - 20)
    assert s["p99_e2e_ms"] == pytest.approx(percentile([120, 220, 400, 2000], 99))
    assert s["mean_itl_ms"] == pytest.approx((10 + 10 + 20 + 50 + 50) / 5)


def test_slo_attainment():
    requests = _requests()
    assert slo_attainment(requests, ttft_ms=1000) == 0.75
    assert slo_attainment(requests, tpot_ms=25) == 0.75  # 10, 20, (no TPOT) meet it; 50 does not
    assert slo_attainment(requests, ttft_ms=1000, tpot_ms=25) == 0.5
    assert slo_attainment(requests) == 1.0
    with pytest.raises(ValueError):
        slo_attainment([], ttft_ms=1)


def test_summarize_empty_raises():
    with pytest.raises(ValueError):
        summarize([])
    assert math.isinf(RequestMetrics.from_timestamps(1.0, [1.0], 5).prefill_throughput_tok_s)
