"""The step trace made visible: the Chrome export of a real engine run (a tiny random model),
a hand-computed export of a made-up run, and the tables and plots drawn from the same data."""

import json
from types import SimpleNamespace

import pytest
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from rich.console import Console
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import SamplingParams, load_model
from minillm.formats import trace_events
from minillm.serving import LLMEngine, Request, StepRecord
from minillm.views.serving_plots import plot_itl, plot_rate_sweep, plot_timeline
from minillm.views.serving_terminal import pool_panel, requests_table, steps_table
from minillm.serving.step_trace import chrome_trace_events, request_spans, spans_by_request, write_chrome_trace

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    return load_model(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("llama_gqa")), device="cpu")


def run(model, num_blocks: int) -> LLMEngine:
    """Four requests, 6 greedy tokens each, blocks of 4 positions, 16 tokens a step.

    With 6 blocks (24 positions) the pool runs out while requests 0 and 1 decode: request 2,
    the newest running one (a 4-token first chunk of its 11-token prompt), is preempted."""
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    return engine


@pytest.fixture(scope="module")
def tight(model) -> LLMEngine:
    engine = run(model, num_blocks=6)
    assert any(step.preempted for step in engine.steps), "the tiny pool should force a preemption"
    return engine


@pytest.fixture(scope="module")
def roomy(model) -> LLMEngine:
    return run(model, num_blocks=64)


def x_events(events, tid):
    return [e for e in events if e["ph"] == "X" and e["tid"] == tid]


@pytest.mark.parametrize("engine_name", ["tight", "roomy"])
def test_chrome_export_of_an_engine_run(engine_name, request, tmp_path):
    engine = request.getfixturevalue(engine_name)
    path = write_chrome_trace(tmp_path / "run.json", engine.steps, engine.requests)
    with open(path) as f:
        trace = json.load(f)
    trace_events.validate(trace)
    events = trace["traceEvents"]
    assert trace["otherData"]["n_steps"] == len(engine.steps)
    assert {e["pid"] for e in events} == {1}
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    requests = list(engine.requests.values())
    assert names == {0: "scheduler", **{1 + i: f"request {r.request_id}" for i, r in enumerate(requests)}}
    assert {e["tid"] for e in events if "tid" in e} == set(names)
    scheduler = x_events(events, 0)
    assert len(scheduler) == len(engine.steps)
    assert [e["args"]["step"] for e in scheduler] == [s.step for s in engine.steps]
    assert {e["name"] for e in events if e["ph"] == "C"} == {"KV blocks", "requests", "KV tokens", "batch tokens"}

    t0 = min(r.arrival_s for r in requests)
    for tid, r in enumerate(requests, start=1):
        mine = x_events(events, tid)
        arrival, finish = (r.arrival_s - t0) * 1e6, (r.finish_s - t0) * 1e6
        for e in mine:  # every span inside [arrival, finish], none overlapping the next
            assert arrival - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= finish + 1e-3, (r.request_id, e)
        for a, b in zip(mine, mine[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
        work = [e for e in mine if e["name"] != "queued"]
        rows = [(s.step, p, d) for s in engine.steps for rid, p, d in s.scheduled if rid == r.request_id]
        assert [(e["args"]["step"], e["name"]) for e in work] == [(s, "prefill" if p else "decode") for s, p, d in rows]
        instants = [e["name"] for e in events if e["ph"] == "i" and e["tid"] == tid]
        assert instants.count("preempted") == r.num_preemptions
        assert instants.count("first token") == 1 and f"finished ({r.finish_reason})" in instants
        queued = [e for e in mine if e["name"] == "queued"]
        assert len(queued) <= 1 + r.num_preemptions
    preempted = [r for r in requests if r.num_preemptions]
    assert bool(preempted) == (engine_name == "tight")
    for r in preempted:  # queued again after the preemption, then its K/V recomputed
        tid = 1 + requests.index(r)
        assert [e["name"] for e in x_events(events, tid)].count("queued") == 1 + r.num_preemptions
        assert any(e["args"].get("recompute") for e in x_events(events, tid) if e["name"] == "prefill")


def test_chrome_events_of_a_hand_made_run():
    """One request: arrives at 10.000 s, prefill 4 tokens in step 0 (10.001-10.003 s), first token at
    10.0028, decode in step 1 (10.003-10.004 s), finished at 10.0038 (the span is cut there)."""
    r = Request("a", [1, 2, 3, 4], SamplingParams(max_new_tokens=2), arrival_s=10.0, output_ids=[5, 6],
                status="finished", finish_reason="length", first_scheduled_s=10.0012,
                token_times_s=[10.0028, 10.0038], finish_s=10.0038)
    steps = [StepRecord(0, 10.001, 10.003, (("a", 4, 0),), 1, 7, 1, num_running=1, num_kv_tokens=4),
             StepRecord(1, 10.003, 10.004, (("a", 0, 1),), 0, 8, 1, finished=("a",))]
    events = chrome_trace_events(steps, [r])
    spans = [(e["name"], e["ts"], e["dur"]) for e in x_events(events, 1)]
    assert spans == [("queued", 0.0, 1000.0), ("prefill", 1000.0, 2000.0), ("decode", 3000.0, 800.0)]
    assert [(e["name"], e["ts"]) for e in x_events(events, 0)] == [("prefill", 1000.0), ("decode", 3000.0)]
    assert x_events(events, 0)[0]["args"]["batch"] == "a:P4"
    instants = {e["name"]: e["ts"] for e in events if e["ph"] == "i"}
    assert instants == {"first token": 2800.0, "finished (length)": 3800.0}
    blocks = [e["args"] for e in events if e["name"] == "KV blocks"]
    assert blocks == [{"used": 1, "free": 7, "cached": 1}, {"used": 0, "free": 8, "cached": 1}]
    merged = request_spans(r, steps, merge=True)
    assert [(s.kind, s.num_tokens) for s in merged] == [("queued", 0), ("prefill", 4), ("decode", 1)]


def test_request_spans_merge_consecutive_steps(tight):
    assert spans_by_request(tight.steps, tight.requests, merge=True) == {
        r.request_id: request_spans(r, tight.steps, merge=True) for r in tight.requests.values()}
    for r in tight.requests.values():
        per_step, merged = request_spans(r, tight.steps), request_spans(r, tight.steps, merge=True)
        assert sum(s.num_tokens for s in merged) == sum(s.num_tokens for s in per_step)
        assert [s.kind for s in merged].count("decode") == 1  # every decode step follows the one before
        for a, b in zip(merged, merged[1:]):
            assert not (a.kind == b.kind and a.last_step is not None and b.first_step == a.last_step + 1)


def test_timeline_has_a_row_of_bars_per_request(tight):
    fig = plot_timeline(tight.requests, tight.steps, title="tight pool")
    ax = fig.axes[0]
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    for row, r in enumerate(tight.requests.values()):
        on_row = [b for b in bars if abs(b.get_y() + b.get_height() / 2 - row) < 1e-9]
        assert len(on_row) == len(request_spans(r, tight.steps, merge=True)) >= 2
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"request {i}" for i in tight.requests]
    crosses = [line for line in ax.lines if line.get_marker() == "x"]
    assert sum(len(line.get_xdata()) for line in crosses) == sum(r.num_preemptions for r in tight.requests.values())
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"queued", "prefill", "decode", "preempted", "finished", "prefill (recompute)"} <= legend


def test_rate_sweep_has_a_line_per_policy_and_percentile():
    rows = [dict(policy=policy, rate_req_s=rate, output_throughput_tok_s=10.0 * rate, goodput_req_s=rate / 2,
                 p50_ttft_ms=rate, p99_ttft_ms=2 * rate, p50_tpot_ms=3.0, p99_tpot_ms=None if rate == 4 else 5.0)
            for policy in ("fcfs", "chunked") for rate in (4, 1, 2, float("inf"))]
    fig = plot_rate_sweep(rows, ttft_slo_ms=100, tpot_slo_ms=50)
    throughput, goodput, ttft, tpot = fig.axes[:4]
    labels = [[line.get_label() for line in ax.lines] for ax in (throughput, goodput, ttft, tpot)]
    assert labels[0] == ["fcfs", "chunked"]
    assert labels[1] == ["fcfs", "chunked", "offered load"]
    assert labels[2] == ["fcfs p50", "fcfs p99", "chunked p50", "chunked p99", "TTFT SLO 100 ms"]
    assert labels[3] == ["fcfs p50", "fcfs p99", "chunked p50", "chunked p99", "TPOT SLO 50 ms"]
    assert list(throughput.lines[0].get_xdata()) == [1, 2, 4, 5.0]  # sorted; inf at 1.25 x 4
    assert [t.get_text() for t in tpot.get_xticklabels()] == ["1", "2", "4", "inf"]
    with pytest.raises(ValueError, match="rate_req_s"):
        plot_rate_sweep([{"policy": "fcfs"}])


def test_itl_plot_marks_each_p99():
    fig = plot_itl({"no chunking": [10.0] * 98 + [200.0, 210.0], "chunked": [12.0] * 100, "empty": []})
    in_order, cdf = fig.axes
    assert [line.get_label() for line in in_order.lines] == ["no chunking", "chunked"]
    p99 = [line for line in cdf.lines if "p99" in line.get_label()]
    assert len(p99) == 2 and p99[0].get_xdata()[0] == pytest.approx(200.1)  # numpy: 98.01 between 200 and 210
    with pytest.raises(ValueError, match="no inter-token"):
        plot_itl({"x": []})


def render(renderable) -> str:
    console = Console(record=True, width=100)
    console.print(renderable)
    return console.export_text()


def test_tables_render_the_run(tight):
    text = render(steps_table(tight.steps))
    assert f"{len(tight.steps)} steps" in text and "0:P7 1:P5 2:P4" in text
    short = render(steps_table(tight.steps, max_rows=4))
    assert f"{len(tight.steps) - 4} steps not shown" in short
    text = render(requests_table(tight.requests))
    assert "Requests: 4, 4 finished" in text and "length" in text
    text = render(pool_panel(tight.cache))
    assert "6 blocks" in text and "no request holds blocks" in text


def test_pool_panel_shows_block_tables(model):
    engine = LLMEngine(model, num_blocks=12, block_size=4, max_num_batched_tokens=16)
    engine.add_request(list(range(1, 10)), SamplingParams(max_new_tokens=4, temperature=0.0))
    engine.step()
    table = engine.cache.allocator.block_tables["0"]
    text = render(pool_panel(engine.cache))
    assert str(table) in text and f"used {len(table)}" in text
    assert text.count("█") >= len(table)


def test_requests_table_of_unfinished_requests():
    waiting = SimpleNamespace(request_id="w", num_prompt_tokens=3, output_ids=[], num_cached_tokens=0,
                              arrival_s=1.0, first_scheduled_s=None, token_times_s=[], finish_s=None,
                              num_preemptions=0, finish_reason=None, status="waiting")
    text = render(requests_table([waiting]))
    assert "Requests: 1, 0 finished" in text and "waiting" in text
