"""Exercise 9: per-request latency metrics (TTFT, TPOT, ITL, e2e, throughput) from timestamps."""

import pytest

from exercises.checking import Case

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
