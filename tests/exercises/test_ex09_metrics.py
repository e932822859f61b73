"""Exercise 9: per-request latency metrics (TTFT, TPOT, ITL, e2e, throughput) from timestamps."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.registry import EXERCISES, reference

pytestmark = pytest.mark.ex09
LESSON = "lessons/06-metrics.md#ttft-and-tpot"
DEFS = ("TTFT = t_1 - start; e2e = t_n - start; TPOT = (e2e - TTFT) / (n - 1), the first token excluded; "
        "ITL = gaps between consecutive tokens; all in milliseconds (timestamps are in seconds)")


def metrics(c, impl, start, times, n_prompt):
    return c.call(impl.RequestMetrics.from_timestamps, start, times, n_prompt)


def test_latencies_by_hand(impl):
    c = Case("RequestMetrics.from_timestamps(10.0, [10.5, 10.6, 10.7, 10.8, 10.9], 100)",
             "start at 10 s; 5 tokens, the first after 0.5 s, then one every 0.1 s", shapes="5 timestamps (s)",
             hint=DEFS, lesson=LESSON)
    m = metrics(c, impl, 10.0, [10.5, 10.6, 10.7, 10.8, 10.9], 100)
    c.close(m.ttft_ms, 500.0, hint="TTFT = t_1 - start, in ms: (10.5 - 10.0) s = 500 ms")
    c.close(m.e2e_ms, 900.0, hint="e2e = t_n - start, in ms")
    c.close(m.tpot_ms, 100.0, hint=DEFS)
    c.close(tuple(m.itl_ms), (100.0,) * 4, hint="ITL: one gap per decode step, n - 1 of them, in ms")


def test_tpot_leaves_out_the_first_token(impl):
    c = Case("RequestMetrics.from_timestamps(0.0, [1.0, 1.1, 1.5], 8)",
             "a slow prefill (TTFT 1000 ms), then gaps of 100 and 400 ms", shapes="3 timestamps (s)",
             hint=DEFS + ": here (1500 - 1000) / 2 = 250 ms, not 1500 / 3", lesson=LESSON)
    m = metrics(c, impl, 0.0, [1.0, 1.1, 1.5], 8)
    c.close(m.ttft_ms, 1000.0)
    c.close(m.tpot_ms, 250.0)


def test_throughputs(impl):
    c = Case("RequestMetrics.from_timestamps(0.0, [1.0, 1.1, 1.5], 100)",
             "100 prompt tokens, 3 output tokens, last one at 1.5 s", shapes="3 timestamps (s)", lesson=LESSON,
             hint="output throughput = n_output / e2e = 3 / 1.5 s = 2 tok/s (the whole request); "
                  "prefill throughput = n_prompt / TTFT = 100 / 1.0 s = 100 tok/s")
    m = metrics(c, impl, 0.0, [1.0, 1.1, 1.5], 100)
    c.close(m.output_throughput_tok_s, 2.0)
    c.close(m.prefill_throughput_tok_s, 100.0)


def test_one_token_has_no_tpot(impl):
    c = Case("RequestMetrics.from_timestamps(0.0, [0.2], 10)", "a request that stopped after its first token",
             shapes="1 timestamp (s)", lesson=LESSON,
             hint="with n = 1 there is no decode step: tpot_ms is None and itl_ms is empty (don't divide by 0)")
    m = metrics(c, impl, 0.0, [0.2], 10)
    c.close(m.ttft_ms, 200.0)
    c.equal(m.tpot_ms, None)
    c.equal(tuple(m.itl_ms), ())


def test_bad_timestamps_are_refused(impl):
    cases = [
        ("RequestMetrics.from_timestamps(0.0, [], 10)", "no output token at all", (0.0, [], 10)),
        ("RequestMetrics.from_timestamps(0.0, [1.0, 0.5, 1.2], 10)",
         "the 2nd token before the 1st: an ITL of -500 ms", (0.0, [1.0, 0.5, 1.2], 10)),
        ("RequestMetrics.from_timestamps(5.0, [4.5, 5.5], 10)", "the first token 0.5 s before the request started",
         (5.0, [4.5, 5.5], 10)),
    ]
    for what, case, args in cases:
        c = Case(what, case, shapes="timestamps (s)", lesson=LESSON,
                 hint="the docstring promises a ValueError for no tokens, decreasing times or a token before the "
                      "start: check the input first (raise ValueError('...')), never report a negative latency")
        c.raises(ValueError, impl.RequestMetrics.from_timestamps, *args)


def test_equal_timestamps_are_fine(impl):
    c = Case("RequestMetrics.from_timestamps(2.0, [2.0, 2.25, 2.25], 4)",
             "a token at the very start and two tokens in the same instant (coarse clocks do this)",
             shapes="3 timestamps (s)", lesson=LESSON,
             hint="non-decreasing is allowed: refuse only a time that goes BACK (b < a) or a token before the "
                  "start; " + DEFS)
    m = metrics(c, impl, 2.0, [2.0, 2.25, 2.25], 4)
    c.close(m.ttft_ms, 0.0)
    c.close(tuple(m.itl_ms), (250.0, 0.0))
    c.close(m.tpot_ms, 125.0)


# -- differential checks (issue 30): every number of tokens, lists and tuples, clocks far from 0, the errors --

REF = reference(EXERCISES["ex09"])


def _graded(fn):
    """from_timestamps with mbu blanked: the exercise leaves mbu free (it may stay None)."""
    def call(*args, **kwargs):
        m = fn(*args, **kwargs)
        return dataclasses.replace(m, mbu=None) if dataclasses.is_dataclass(m) and hasattr(m, "mbu") else m
    return call


GAP = st.sampled_from([0.0, 0.001, 0.1, 0.5]) | st.floats(1e-6, 5.0)


@given(data=st.data())
@CHECKS
def test_agrees_with_the_reference_on_any_timestamps(impl, data):
    start = data.draw(st.sampled_from([0.0, 2.0, 12345.678]) | st.floats(0, 1e5), label="start_s")
    n = data.draw(st.sampled_from([1, 2]) | st.integers(0, 9), label="n_tokens")
    gaps = data.draw(st.lists(GAP, min_size=n, max_size=n), label="gaps (s): first token, then each next one")
    times, t = [], start
    for gap in gaps:
        t += gap
        times.append(t)
    broken = data.draw(st.sampled_from([None, None, None, "a time going back", "a token before the start"]),
                       label="invalid input")
    if broken == "a time going back" and n >= 2:
        i = data.draw(st.integers(1, n - 1), label="index going back")
        times[i] = times[i - 1] - data.draw(st.sampled_from([1e-3, 0.5]), label="back by (s)")
    elif broken == "a token before the start" and n >= 1:
        times[0] = start - data.draw(st.sampled_from([1e-3, 0.5]), label="early by (s)")
    kind = data.draw(st.sampled_from([list, tuple]), label="token_times_s as")
    n_prompt = data.draw(st.sampled_from([0, 1, 100]) | st.integers(0, 5000), label="n_prompt_tokens")
    extra = data.draw(st.sampled_from([{}, {"bytes_per_decode_step": 15e9, "peak_bandwidth": 3.35e12}]),
                      label="mbu arguments")
    agree(_graded(impl.RequestMetrics.from_timestamps), _graded(REF.RequestMetrics.from_timestamps),
          lambda: ((start, kind(times), n_prompt), dict(extra)), tol=(1e-6, 1e-9),
          what="RequestMetrics.from_timestamps", exercise="ex09", lesson=LESSON,
          hint=DEFS + "; with one token: tpot_ms None, itl_ms () and the ITL percentiles None; itl_ms is a tuple; "
                      "a zero TTFT or e2e gives an infinite throughput (math.inf); ValueError for no tokens, a "
                      "decreasing time or a token before the start (equal times are fine)")
