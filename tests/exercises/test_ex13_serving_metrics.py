"""Exercise 13: percentiles, SLO attainment and goodput over a list of requests."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.registry import EXERCISES, reference
from minillm.metrics import RequestMetrics

pytestmark = pytest.mark.ex13
LESSON = "lessons/06-metrics.md#percentiles"
SLO_LESSON = "lessons/06-metrics.md#slos"
PERCENTILE = ("sort the values; the p-th percentile sits at the fractional rank r = (n - 1) · p / 100; "
              "interpolate between sorted[floor(r)] and sorted[ceil(r)] (numpy.percentile's default, vLLM's)")
SLO = ("a request meets the SLOs when TTFT <= ttft_ms AND TPOT <= tpot_ms (<=: exactly on the limit is met); "
       "an SLO left None is not checked; a one-token request has no TPOT and meets any TPOT SLO")
SLO_ATTAINMENT = SLO + "; the attainment is the fraction of requests that meet them, in [0, 1]"
GOODPUT = "goodput = (requests meeting every SLO) / duration_s, in requests per second; " + SLO


def request(ttft_ms: float, tpot_ms: float | None) -> RequestMetrics:
    """A request with exactly this TTFT and TPOT (None: it stopped after a single token)."""
    n = 1 if tpot_ms is None else 4
    m = RequestMetrics.from_timestamps(0.0, [1.0 + k for k in range(n)], 16)
    return replace(m, ttft_ms=float(ttft_ms), tpot_ms=None if tpot_ms is None else float(tpot_ms))


# TTFT (ms), TPOT (ms): the batch the SLO checks grade
REQUESTS = [(200, 40), (900, 60), (1000, 50), (1500, 20), (300, None)]


def test_percentile_by_hand(impl):
    for values, p, expected in [([1, 2, 3, 4], 50, 2.5), ([40, 15, 50, 20, 35], 90, 46.0),
                                ([40, 15, 50, 20, 35], 40, 29.0), ([7.5], 99, 7.5)]:
        c = Case(f"percentile({values}, {p})", "a few values, unsorted where they are given unsorted",
                 shapes=f"{len(values)} values", hint=PERCENTILE, lesson=LESSON)
        c.close(c.call(impl.percentile, values, p), expected)


def test_percentile_matches_numpy_on_latencies(impl):
    ttfts = np.random.default_rng(0).lognormal(mean=5.0, sigma=0.8, size=37).tolist()
    for p in (0, 50, 90, 99, 100):
        c = Case(f"percentile(ttft_ms, {p})", "37 TTFTs of a benchmark (a long right tail), the oracle is "
                 f"numpy.percentile: {np.percentile(ttfts, p):.3f} ms", shapes="37 values (ms)", hint=PERCENTILE,
                 lesson=LESSON)
        c.close(c.call(impl.percentile, ttfts, p), float(np.percentile(ttfts, p)))


def test_one_value_is_every_percentile(impl):
    for values, p in [([7], 0), ([7], 37.5), ((7,), 100)]:
        c = Case(f"percentile({values!r}, {p})", "a single value: it is every percentile, as a float",
                 shapes="1 value -> a float", lesson=LESSON,
                 hint="n = 1: the rank (n - 1) · p / 100 is 0 for every p, so the answer is the value, returned as "
                      "a float like every other percentile (7.0, not the int 7); " + PERCENTILE)
        got = c.call(impl.percentile, values, p)
        c.true(type(got) is float and got == 7.0, "not the value as a float", expected=7.0, got=repr(got))


def test_percentile_errors(impl):
    for args, case in [(([], 50), "no values"), (([1.0, 2.0], 101), "p = 101"), (([1.0, 2.0], -1), "p = -1")]:
        c = Case(f"percentile{args}", case, shapes="", lesson=LESSON,
                 hint="the docstring promises a ValueError for no values or p outside [0, 100]")
        c.raises(ValueError, impl.percentile, *args)


def test_slo_attainment_by_hand(impl):
    ms = [request(t, p) for t, p in REQUESTS]
    for ttft, tpot, expected in [(1000, None, 4 / 5), (None, 50, 4 / 5), (1000, 50, 3 / 5), (None, None, 1.0),
                                 (100, None, 0.0)]:
        c = Case(f"slo_attainment(requests, ttft_ms={ttft}, tpot_ms={tpot})",
                 "5 requests (TTFT ms, TPOT ms): " + ", ".join(map(str, REQUESTS)) + " (None: a single token)",
                 shapes="5 RequestMetrics", hint=SLO_ATTAINMENT, lesson=SLO_LESSON)
        c.close(c.call(impl.slo_attainment, ms, ttft, tpot), expected)


def test_goodput_by_hand(impl):
    ms = [request(t, p) for t, p in REQUESTS]
    c = Case("goodput(requests, duration_s=2.0, ttft_ms=1000, tpot_ms=50)",
             "5 requests in 2 s (throughput 2.5 req/s); 3 meet both SLOs (TTFT, TPOT ms): " + ", ".join(
                 map(str, REQUESTS)), shapes="5 RequestMetrics", hint=GOODPUT, lesson=SLO_LESSON)
    c.close(c.call(impl.goodput, ms, 2.0, 1000, 50), 1.5)
    c = Case("goodput(requests, duration_s=4.0)", "the same 5 requests in 4 s, no SLO given: every request is good",
             shapes="5 RequestMetrics", hint=GOODPUT, lesson=SLO_LESSON)
    c.close(c.call(impl.goodput, ms, 4.0), 1.25)


def test_slo_errors(impl):
    ms = [request(200, 40)]
    cases = [("slo_attainment([], ttft_ms=1000)", "no requests", impl.slo_attainment, ([], 1000)),
             ("goodput([], 1.0)", "no requests", impl.goodput, ([], 1.0)),
             ("goodput(requests, 0.0)", "a duration of 0 s", impl.goodput, (ms, 0.0)),
             ("goodput(requests, -2.0)", "a negative duration", impl.goodput, (ms, -2.0))]
    for what, case, fn, args in cases:
        c = Case(what, case, shapes="", lesson=SLO_LESSON,
                 hint="the docstrings promise a ValueError for an empty list and for duration_s <= 0")
        c.raises(ValueError, fn, *args)


# -- differential checks (issue 30): every Iterable kind, every rank, SLOs on and off the limit ------------

REF = reference(EXERCISES["ex13"])


class Stream:
    """A one-pass iterator, as a generator expression is: no len(), no sort(), no indexing, truthy when empty."""

    def __init__(self, values):
        self._values, self._it = list(values), iter(list(values))

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def __repr__(self) -> str:
        return f"(v for v in {self._values})"


KINDS = {"list": list, "tuple": tuple, "generator": Stream}
VALUE = st.floats(0, 1e5, allow_nan=False) | st.sampled_from([0.0, 1.0, 2.5, 40.0]) | st.floats(-1e4, 0)


@given(data=st.data())
@CHECKS
def test_percentile_agrees_with_the_reference_on_every_iterable(impl, data):
    kind = data.draw(st.sampled_from(list(KINDS)), label="values as")
    values = data.draw(st.lists(VALUE, max_size=12), label="values")
    p = data.draw(st.sampled_from([0, 100, 50, 90, 99, 99.9, 0.0, 100.0]) | st.floats(0, 100)
                  | st.sampled_from([-1, -0.5, 100.5, 101, 1000]), label="p")
    agree(impl.percentile, REF.percentile, lambda: ((KINDS[kind](values), p), {}), tol=(1e-7, 1e-9),
          what="percentile", exercise="ex13", lesson=LESSON,
          hint=PERCENTILE + "; values is any Iterable (a tuple such as RequestMetrics.itl_ms, or a generator): "
                            "make your own sorted list (sorted(values)) and leave the caller's values alone; "
                            "ValueError for no values or p outside [0, 100]")


def _requests(draw_list):
    return [request(t, p) for t, p in draw_list]


TTFT = st.sampled_from([0.0, 200.0, 500.0, 1000.0, 1500.0]) | st.floats(0, 3000)
TPOT = st.none() | st.sampled_from([20.0, 50.0, 60.0]) | st.floats(0, 200)
SLO_TTFT = st.none() | st.sampled_from([500, 1000, 1000.0, 200.0]) | st.floats(0, 3000)
SLO_TPOT = st.none() | st.sampled_from([50, 50.0, 20.0]) | st.floats(0, 200)


@given(data=st.data())
@CHECKS
def test_slo_attainment_and_goodput_agree_with_the_reference(impl, data):
    pairs = data.draw(st.lists(st.tuples(TTFT, TPOT), max_size=8), label="requests (TTFT ms, TPOT ms)")
    kind = data.draw(st.sampled_from([list, tuple]), label="metrics_list as")
    ttft_ms, tpot_ms = data.draw(SLO_TTFT, label="ttft_ms"), data.draw(SLO_TPOT, label="tpot_ms")
    duration = data.draw(st.sampled_from([1.0, 2.0, 0.5, 0.0, -1.0]) | st.floats(1e-3, 1e3), label="duration_s")
    ms = _requests(pairs)
    agree(impl.slo_attainment, REF.slo_attainment, lambda: ((kind(ms),), {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}),
          what="slo_attainment", exercise="ex13", lesson=SLO_LESSON,
          hint=SLO_ATTAINMENT + "; ValueError for no requests")
    agree(impl.goodput, REF.goodput, lambda: ((kind(ms), duration), {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}),
          what="goodput", exercise="ex13", lesson=SLO_LESSON,
          hint=GOODPUT + "; ValueError for no requests or duration_s <= 0")
