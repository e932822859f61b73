"""The client-side serving benchmark (minillm/bench/http_client.py) and /metrics scraping.

The oracle for the client's timing is a stub OpenAI-compatible server written here, which
streams at known delays (first chunk after TTFT_S, then one every ITL_S) and keeps
Prometheus histograms of those same nominal delays: the client's TTFT/ITL must come out
at the delays, the server-side mean at them exactly, and the server-side p50 at the value
Prometheus's histogram_quantile formula gives for the stub's buckets, computed by hand.
Counting tokens per chunk is checked on hand-made events. Servers listen on 127.0.0.1 only,
on a free port, and stop at the end of each test.

No assertion bounds a measured duration from above (a loaded machine stretches every one):
a measured delay is checked to be at least the stub's sleep, a client stamp to come after the
stub sent that chunk (the stub logs its send times on the same perf_counter), and the send
schedule is checked exactly on a fake clock (:class:`FakeClock`, the client's clock seam).
"""

import asyncio
import contextlib
import heapq
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest  # noqa: E402

from minillm.bench import http_client as hb  # noqa: E402
from minillm.bench.metrics_scrape import histogram_quantile, scrape_delta  # noqa: E402
from minillm.bench.workload import make_workload  # noqa: E402

TTFT_S, ITL_S = 0.3, 0.1
BUCKETS_S = (0.05, 0.25, 0.5, 1.0)
FAIL_MAX_TOKENS = 7  # the stub answers 400 to this max_tokens
HANG_MAX_TOKENS = 9  # ... and never answers this one


def stub_app() -> FastAPI:
    """An OpenAI-compatible stub: streams max_tokens one-token chunks (text "t<i> "), then the usage.

    ``app.state.received``: the prompts (tuples), in the order their requests came in;
    ``app.state.sent``: prompt -> ``time.perf_counter()`` just before each chunk was sent."""
    app, registry = FastAPI(), CollectorRegistry()
    app.state.received, app.state.sent = [], {}
    ttft = Histogram("minillm:time_to_first_token_seconds", "", registry=registry, buckets=BUCKETS_S)
    itl = Histogram("minillm:inter_token_latency_seconds", "", registry=registry, buckets=BUCKETS_S)
    tokens = Counter("minillm:generation_tokens", "", registry=registry)
    success = Counter("minillm:request_success", "", ["finished_reason"], registry=registry)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode())

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = body["max_tokens"]
        if n == FAIL_MAX_TOKENS:
            return JSONResponse({"error": {"message": "max_tokens 7 is unlucky", "type": "invalid_request_error",
                                           "param": "max_tokens", "code": None}}, status_code=400)

        prompt = tuple(body["prompt"])
        app.state.received.append(prompt)
        sent = app.state.sent.setdefault(prompt, [])

        async def events():
            await asyncio.sleep(3600 if n == HANG_MAX_TOKENS else TTFT_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_S)
                sent.append(time.perf_counter())
                choice = {"index": 0, "text": f"t{i} ", "finish_reason": "length" if i == n - 1 else None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            ttft.observe(TTFT_S)
            for _ in range(n - 1):
                itl.observe(ITL_S)
            tokens.inc(n)
            success.labels("length").inc()
            n_prompt = len(body["prompt"])
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def serve(app, timeout_s: float = 20.0):
    """uvicorn on 127.0.0.1, a free port, in a thread; yields the base URL; stopped on exit."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


@pytest.fixture(scope="module")
def stub():
    return stub_app()


@pytest.fixture(scope="module")
def stub_url(stub):
    with serve(stub) as url:
        yield url


class FakeClock:
    """Seconds that pass only in ``sleep``: the client's clock seam (``clock=``, ``sleep=``).

    A sleeper wakes when no other sleeper is due earlier, and sets the time to its own due
    time, so the requests go out in arrival order, each at exactly its arrival."""

    def __init__(self):
        self.now_s, self.due_s = 0.0, []  # due_s: a heap of the sleepers' wake-up times

    def __call__(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        due = self.now_s + seconds
        heapq.heappush(self.due_s, due)
        while self.due_s[0] < due:
            await asyncio.sleep(0)  # an earlier sleeper goes first
        heapq.heappop(self.due_s)
        self.now_s = max(self.now_s, due)


def workload(n: int, max_tokens: str = "4", rate=None, seed: int = 0):
    return make_workload(n, "uniform:3-8", max_tokens, rate=rate, seed=seed, vocab_size=100)


@pytest.mark.server
def test_client_side_ttft_and_itl_follow_the_stub_delays(stub, stub_url):
    result = hb.run_http_bench(stub_url, workload(4), ttft_slo_ms=1e6, tpot_slo_ms=1e6, timeout_s=30)
    s = result.summary
    assert result.model == "stub" and result.n_failed == 0 and s.n_completed == 4
    assert s.total_output_tokens == 16 and result.n_count_mismatch == 0 and result.n_without_usage == 0
    # a measured delay can only be late: at least the stub's sleeps (never "at most": load stretches it)
    assert s.p50_ttft_ms >= TTFT_S * 1e3 and s.mean_e2e_ms >= (TTFT_S + 3 * ITL_S) * 1e3
    assert s.mean_tpot_ms == pytest.approx(s.mean_itl_ms)  # one token per chunk: TPOT is the mean gap
    gaps = sorted(b - a for r in result.requests for a, b in zip(r.token_times_s, r.token_times_s[1:]))
    assert s.p50_itl_ms == pytest.approx(1e3 * (gaps[5] + gaps[6]) / 2)  # the 12 gaps' median
    for r in result.requests:
        # each chunk stamped on arrival: after the stub sent it, one stamp per chunk, in order
        sent = stub.state.sent[tuple(workload(4)[int(r.request_id)].prompt_ids)][-4:]
        assert all(c >= s for c, s in zip(r.token_times_s, sent))
        assert r.token_times_s == sorted(set(r.token_times_s)) and r.token_times_s[0] >= r.arrival_s + TTFT_S
        assert r.finish_reason == "length" and r.num_chunks == 4 and r.text == "t0 t1 t2 t3 "
        assert r.num_prompt_tokens == len(workload(4)[int(r.request_id)].prompt_ids)
    assert s.slo_attainment == 1.0 and s.goodput_req_s == pytest.approx(4 / s.duration_s)


@pytest.mark.server
def test_each_request_is_sent_at_its_poisson_arrival(stub, stub_url):
    w = workload(5, rate=10.0, seed=3)
    clock = FakeClock()
    clock.now_s = 100.0  # the client's t0 comes from the clock, not from 0
    del stub.state.received[:]
    result = asyncio.run(hb.run_http_bench_async(stub_url, w, "stub", timeout_s=30, warm_up_first=False,
                                                 clock=clock, sleep=clock.sleep))
    assert result.n_failed == 0 and result.requests[-1].arrival_s == pytest.approx(100.0 + w[-1].arrival_s)
    for r, x in zip(result.requests, w):
        assert r.arrival_s == pytest.approx(100.0 + x.arrival_s)  # the workload's arrivals, on the client's clock
        assert r.first_scheduled_s == pytest.approx(r.arrival_s)  # slept until then, no earlier, no later
    assert stub.state.received == [x.prompt_ids for x in w]  # so they reached the server in arrival order
    assert result.summary.mean_queue_ms == pytest.approx(0.0, abs=1e-9)


def most_in_flight(requests) -> int:
    """The most requests between their send (arrival_s) and their last token at any moment."""
    events = sorted([(r.arrival_s, 1) for r in requests] + [(r.token_times_s[-1], -1) for r in requests])
    level = peak = 0
    for _, step in events:  # (an end at the very time of a send counts first: -1 sorts before 1)
        level += step
        peak = max(peak, level)
    return peak


@pytest.mark.server
@pytest.mark.parametrize("cap, expected", [(2, 2), (None, 6)])
def test_max_concurrency_keeps_that_many_requests_in_flight(stub_url, cap, expected):
    result = hb.run_http_bench(stub_url, workload(6, seed=2), timeout_s=30, max_concurrency=cap)
    assert result.n_failed == 0 and most_in_flight(result.requests) == expected
    for r in result.requests:  # TTFT from the send, not from the wait for a slot
        assert r.token_times_s[0] - r.arrival_s >= TTFT_S and r.first_scheduled_s >= r.arrival_s


def test_max_concurrency_below_one_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^max_concurrency must be >= 1 \(None: no limit\), got 0$"):
        hb.run_http_bench("http://127.0.0.1:9", workload(1), model="stub", max_concurrency=0)


@pytest.mark.server
def test_server_side_numbers_are_the_difference_of_two_scrapes(stub_url):
    hb.run_http_bench(stub_url, workload(2, seed=1), timeout_s=30)  # earlier traffic the delta must leave out
    result = hb.run_http_bench(stub_url, workload(3, "5"), timeout_s=30)
    server = result.server
    assert server is not None and server.prefix == "minillm:"
    ttft, itl = server.stats_ms("ttft"), server.stats_ms("itl")
    assert ttft["count"] == 3 and ttft["mean"] == pytest.approx(TTFT_S * 1e3)
    assert itl["count"] == 3 * 4 and itl["mean"] == pytest.approx(ITL_S * 1e3)
    # every TTFT in (0.25, 0.5]: Prometheus interpolates rank 1.5 of 3 to 0.25 + 0.25 * 1.5 / 3
    assert ttft["p50"] == pytest.approx((0.25 + 0.25 * 1.5 / 3) * 1e3)
    assert server.counters["generation_tokens_total"] == 15
    assert server.counters["request_success_total{length}"] == 3
    assert "e2e" not in server.latencies and "e2e" in result.server_note
    assert result.ttft_gap_ms() == pytest.approx(result.summary.mean_ttft_ms - ttft["mean"])
    assert result.ttft_gap_ms() >= 0  # the client sees the stub's delays plus HTTP (load only adds to it)


@pytest.mark.server
def test_failures_are_counted_and_never_crash_the_run(stub_url):
    w = workload(4)
    w[1] = type(w[1])(w[1].arrival_s, w[1].prompt_ids, FAIL_MAX_TOKENS)
    w[2] = type(w[2])(w[2].arrival_s, w[2].prompt_ids, HANG_MAX_TOKENS)
    start = time.perf_counter()
    result = hb.run_http_bench(stub_url, w, model="stub", timeout_s=2.0)
    # the hanging request (the stub sleeps an hour) ended the run at the overall timeout: not before
    # it (a lower bound; load can only make it later), and by cancelling that request
    assert time.perf_counter() - start >= 2.0
    assert result.requests[2].error == "cancelled: the run's overall timeout passed"
    assert result.n_failed == 2 and result.summary.n_completed == 2 and result.summary.n_aborted == 2
    assert result.requests[1].error == "HTTP 400: max_tokens 7 is unlucky"
    assert result.summary.total_output_tokens == 8


@pytest.mark.server
def test_a_server_that_is_not_there_fails_every_request_in_one_line():
    with serve(FastAPI()) as url:
        pass  # started and stopped: nothing listens on that port any more
    with pytest.raises(ValueError, match="the warm-up request to .* failed: ConnectError"):
        hb.run_http_bench(url, workload(3), model="any", timeout_s=10)
    result = hb.run_http_bench(url, workload(3), model="any", timeout_s=10, warm_up_first=False)
    assert result.n_failed == 3 and result.summary.n_completed == 0 and result.summary.total_output_tokens == 0
    assert all(e.startswith("ConnectError") for e in result.errors)
    assert result.server is None and "no /metrics" in result.server_note
    with pytest.raises(ValueError, match="is the server running"):
        hb.run_http_bench(url, workload(1), timeout_s=10)  # no --model: /v1/models must answer


# -- against minillm serve -------------------------------------------------------------------------


@pytest.mark.server
def test_minillm_serve_gives_every_request_max_tokens_and_its_metrics_match_the_client(tiny_chat):
    from live_server import live_server

    import minillm
    from minillm.bench.workload import safe_token_ids

    model, tokenizer = tiny_chat
    w = make_workload(6, "uniform:4-24", "uniform:3-8", rate=20, seed=0, token_ids=safe_token_ids(tokenizer))
    with live_server(model, tokenizer, num_blocks=128) as url:
        result = hb.run_http_bench(url, w, ttft_slo_ms=1e6, tpot_slo_ms=1e6, timeout_s=120)
        with pytest.raises(ValueError, match="warm-up request .* failed: HTTP 404"):
            hb.run_http_bench(url, w, model="not-served", timeout_s=30)
    assert result.model == "minillm-test" and result.n_failed == 0 and result.n_count_mismatch == 0
    assert [len(r.token_times_s) for r in result.requests] == [x.max_tokens for x in w]
    assert [r.usage_completion_tokens for r in result.requests] == [x.max_tokens for x in w]
    assert {r.finish_reason for r in result.requests} == {"length"}
    assert result.summary.total_cached_tokens == 0  # distinct prompts; the warm-up left nothing to hit
    greedy = [s.token_id for s in minillm.generate(model, list(w[0].prompt_ids),
                                                   minillm.SamplingParams(max_new_tokens=w[0].max_tokens),
                                                   eos_token_ids=[])]
    assert result.requests[0].text == tokenizer.decode(greedy)
    server = result.server
    assert server.prefix == "minillm:" and server.note == ""
    assert server.stats_ms("ttft")["count"] == server.stats_ms("e2e")["count"] == 6
    assert server.stats_ms("itl")["count"] == sum(x.max_tokens - 1 for x in w)
    n_out = sum(x.max_tokens for x in w)
    assert server.counters["generation_tokens_total"] == result.summary.total_output_tokens == n_out
    assert server.counters["prompt_tokens_total"] == sum(len(x.prompt_ids) for x in w)
    assert server.counters["request_success_total{length}"] == 6
    # the client's clock starts at the arrival, before the server's, and stops after it
    assert result.ttft_gap_ms() >= 0 and result.summary.mean_e2e_ms >= server.stats_ms("e2e")["mean"]


@pytest.mark.server
def test_a_server_with_an_api_key_and_the_openai_clients_base_url(tiny_chat, monkeypatch, capsys):
    from live_server import live_server

    from minillm.cli import main

    model, tokenizer = tiny_chat
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with live_server(model, tokenizer, num_blocks=64, api_key="s3cret") as url:
        argv = ["bench-serving", "--base-url", f"{url}/v1", "--tokenizer", "smollm2-135m-instruct",
                "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "-q"]
        assert main(argv) == 2  # no key: the server's 401, in one line
        assert "401" in capsys.readouterr().err
        assert main([*argv, "--api-key", "s3cret"]) == 0  # ".../v1" as the openai client's base_url is accepted
        assert "0 of 2 requests failed" in capsys.readouterr().out
        monkeypatch.setenv("OPENAI_API_KEY", "s3cret")  # as the openai client reads it
        assert main(argv) == 0


# -- counting tokens per chunk, on hand-made events -------------------------------------------------


def feed(events: list[tuple[float, dict]]) -> hb.ClientRequest:
    record, last_seen = hb.ClientRequest("0", arrival_s=0.0, first_scheduled_s=0.0, num_prompt_tokens=3), None
    for t, event in events:
        last_seen = hb._read_event(event, t, record, last_seen)
    hb._finish(record, last_seen)
    return record


def usage(n: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n,
                                     "prompt_tokens_details": {"cached_tokens": 2}}}


def text(s: str, **extra) -> dict:
    return {"choices": [{"index": 0, "text": s, **extra}]}


def test_a_chunk_with_token_ids_carries_that_many_tokens():
    r = feed([(1.0, text("ab", token_ids=[5, 6])), (1.5, text("c", token_ids=[7], finish_reason="length")),
              (2.0, usage(3))])
    assert r.token_times_s == [1.0, 1.0, 1.5] and r.chunk_tokens == 3 and r.num_cached_tokens == 2
    assert r.finish_reason == "length" and r.error is None


def test_logprobs_tokens_count_when_there_are_no_token_ids():
    r = feed([(1.0, text("ab", logprobs={"tokens": ["a", "b"]}, finish_reason="stop")), (2.0, usage(2))])
    assert r.token_times_s == [1.0, 1.0]


def test_held_back_text_gets_the_usage_count_at_the_last_text_chunk():
    # the second token's text was held back (an empty chunk), then sent with the third's
    r = feed([(1.0, text("a")), (1.2, text("")), (1.4, text("bc", finish_reason="length")), (1.5, usage(3))])
    assert r.chunk_tokens == 2 and r.usage_completion_tokens == 3
    assert r.token_times_s == [1.0, 1.4, 1.4] and r.finish_reason == "length"


def test_more_chunks_than_the_usage_are_trimmed_from_the_end():
    r = feed([(1.0, text("a")), (1.1, text("b")), (1.2, text("c", finish_reason="length")), (1.3, usage(2))])
    assert r.token_times_s == [1.0, 1.1]


def test_missing_tokens_never_go_before_a_later_token_only_chunk():
    # a last chunk with token ids but no text yet: the missing token is timed at it, not earlier
    r = feed([(1.0, text("a")), (1.3, text("", token_ids=[9], finish_reason="length")), (1.4, usage(3))])
    assert r.token_times_s == [1.0, 1.3, 1.3]


def test_an_error_event_or_an_empty_stream_fails_the_request():
    r = feed([(1.0, text("a")), (1.1, {"error": {"message": "engine died"}})])
    assert r.finish_reason == "abort" and "engine died" in r.error
    r = feed([(1.0, usage(0))])
    assert r.finish_reason == "abort" and "without any output token" in r.error
    r = feed([(1.0, text("a")), (1.1, text("b"))])  # cut off: no finish_reason, no usage
    assert r.finish_reason == "abort" and "no finish_reason, after 2 tokens" in r.error
    with pytest.raises(ValueError, match="not an OpenAI chunk"):
        feed([(1.0, {"choices": ["a"]})])


# -- Prometheus's histogram_quantile, by hand ---------------------------------------------------------


@pytest.mark.parametrize("q, expected", [
    (0.5, 0.025 + 0.025 * (5 - 2) / 4),  # rank 5 in (0.025, 0.05], which holds ranks 3..6
    (0.1, 0.025 * 1 / 2),                # rank 1 in the first bucket, which starts at 0
    (1.0, 0.1),                          # rank 10: the last finite bucket ends at 10
])
def test_histogram_quantile_interpolates_inside_the_bucket(q, expected):
    buckets = ((0.025, 2), (0.05, 6), (0.1, 10), (float("inf"), 10))
    assert histogram_quantile(q, buckets) == pytest.approx(expected)


def test_histogram_quantile_in_the_inf_bucket_is_the_last_finite_bound():
    assert histogram_quantile(0.99, ((0.1, 1), (1.0, 2), (float("inf"), 10))) == 1.0
    assert histogram_quantile(0.5, ((0.1, 0), (float("inf"), 0))) is None


def test_vllm_names_are_read_when_minillm_names_are_absent():
    def text_of(count: int, total_s: float) -> str:
        return (f'vllm:time_to_first_token_seconds_bucket{{le="0.5",model_name="m"}} {count}\n'
                f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {count}\n'
                f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {count}\n'
                f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {total_s}\n')

    numbers = scrape_delta(text_of(2, 0.4), text_of(6, 1.2))
    assert numbers.prefix == "vllm:" and numbers.stats_ms("ttft")["mean"] == pytest.approx(200.0)
    assert scrape_delta("", "other_metric 1\n").prefix is None


# -- the CLI ------------------------------------------------------------------------------------------


@pytest.mark.server
def test_cli_prints_the_tables_and_the_client_vs_server_comparison(stub_url, tmp_path, capsys):
    from minillm.cli import main

    out_json = tmp_path / "http.json"
    argv = ["bench-serving", "--base-url", stub_url, "--tokenizer", "smollm2-135m-instruct", "--num-prompts", "3",
            "--input-len", "4", "--output-len", "3", "--request-rate", "inf", "20", "--json", str(out_json), "-q"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Serving 3 requests: throughput" in printed and "Client vs server (ms) @ 20 req/s" in printed
    assert "0 of 3 requests failed" in printed and "server counted 9 output tokens, the client 9" in printed
    doc = json.loads(out_json.read_text())
    assert doc["model"] == "stub" and [(run["policy"], run["rate_req_s"]) for run in doc["runs"]] == [
        ("http", "inf"), ("http", 20.0)]
    for run in doc["runs"]:
        assert run["summary"]["total_output_tokens"] == 9 and run["n_failed"] == 0
        assert run["server"]["latencies_ms"]["ttft"]["mean"] == pytest.approx(TTFT_S * 1e3)
        per_request = run["requests"]
        assert [r["output_tokens"] for r in per_request] == [3, 3, 3]
        assert sum(r["e2e_ms"] for r in per_request) / 3 == pytest.approx(run["summary"]["mean_e2e_ms"])
        for r in per_request:  # TPOT from its own e2e and TTFT; those at least the stub's sleeps
            assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / 2)
            assert r["ttft_ms"] >= TTFT_S * 1e3 and r["e2e_ms"] >= (TTFT_S + 2 * ITL_S) * 1e3


@pytest.mark.server
@pytest.mark.parametrize("extra, message", [
    (["--tokenizer", "no-such-model-here"], "no local tokenizer for 'no-such-model-here'"),
    (["--plots", "x"], "--plots need the model in this process"),
    (["--timeout", "0"], "--timeout must be a number of seconds > 0"),
])
def test_cli_usage_errors_are_one_line(stub_url, capsys, extra, message):
    from minillm.cli import main

    assert main(["bench-serving", "--base-url", stub_url, "--num-prompts", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.server
def test_cli_without_a_tokenizer_for_the_served_model_says_how_to_give_one(stub_url, capsys):
    from minillm.cli import main

    assert main(["bench-serving", "--base-url", stub_url, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "no local tokenizer for 'stub'" in err and "give --tokenizer MODEL" in err
