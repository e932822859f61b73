"""engine_state: the web view's JSON picture of an engine, against the engine's own numbers.

A tiny model, block_size 4, stepped by hand: request a (a 23-token prompt), then b with the
same prompt one step later, so b hits a's 5 full prompt blocks ((23 - 1) // 4) and shares
them (ref count 2); a third request waits while max_num_seqs is 2. Every count the page
draws must be the allocator's, block by block, and every TTFT/TPOT the request's own
timestamps measured from arrival.
"""

import json
import re
import threading

import pytest
import torch

from minillm import LLMEngine, SamplingParams
from minillm.serving.server.web_view import engine_state, page_html

B, MAX_NEW = 4, 4


def prompt(n, seed):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected_block(pool, block_id):
    """What the allocator itself says about one block (an independent walk of its tables)."""
    block = pool.blocks[block_id]
    if block.ref_count == 0:
        return {"state": "cached" if block.block_hash is not None else "free"}
    holders = [rid for rid, table in pool.block_tables.items() if block_id in table]
    return {"state": "used", "request_ids": holders, "ref_count": block.ref_count}


def states_count(pool_state, name):
    return [b["state"] for b in pool_state["blocks"]].count(name)


def check_pool(state, pool):
    s = state["pool"]
    assert (s["num_blocks"], s["block_size"]) == (pool.num_blocks, B)
    assert (s["num_used_blocks"], s["num_free_blocks"], s["num_cached_blocks"]) == \
        (pool.num_used_blocks, pool.num_free_blocks, pool.num_cached_blocks)
    cached_free = [i for i in pool.free_queue if pool.blocks[i].block_hash is not None]  # the free queue's view
    assert s["num_cached_free_blocks"] == states_count(s, "cached") == len(cached_free)
    assert s["blocks"] == [expected_block(pool, i) for i in range(pool.num_blocks)]
    states = [b["state"] for b in s["blocks"]]
    assert states.count("used") == pool.num_used_blocks
    assert states.count("free") + states.count("cached") == pool.num_free_blocks
    assert sum(b.get("ref_count", 0) for b in s["blocks"]) == sum(map(len, pool.block_tables.values()))


@pytest.fixture
def engine(tiny_model):
    return LLMEngine(tiny_model("llama_gqa"), num_blocks=24, block_size=B, max_num_seqs=2, eos_token_ids=())


def test_state_matches_the_engine_step_by_step(engine):
    pool, params = engine.cache.allocator, SamplingParams(max_new_tokens=MAX_NEW)
    assert engine_state(engine)["step"] is None and engine_state(engine)["finished"] == []
    a = engine.add_request(prompt(23, 0), params)
    engine.step()
    b = engine.add_request(prompt(23, 0), params)
    c = engine.add_request(prompt(9, 1), params)  # waits: max_num_seqs is 2
    engine.step()

    state = engine_state(engine)
    check_pool(state, pool)
    shared = pool.block_tables[a][:5]
    for i in shared:
        assert state["pool"]["blocks"][i] == {"state": "used", "request_ids": [a, b], "ref_count": 2}
    assert state["queues"] == {"waiting": 1, "running": 2}
    assert state["waiting"] == [{"request_id": c, "num_prompt_tokens": 9, "num_output_tokens": 0, "num_preemptions": 0}]
    step = state["step"]
    assert step["index"] == 1 and step["rows"] == [
        {"request_id": a, "prefill_tokens": 0, "decode_tokens": 1},
        {"request_id": b, "prefill_tokens": 3, "decode_tokens": 0},  # only what the prefix cache missed
    ]
    assert (step["num_prefill_tokens"], step["num_decode_tokens"]) == (3, 1)
    assert step["duration_ms"] == pytest.approx(engine.steps[1].time_ms, abs=1e-3) and step["age_ms"] >= 0
    running = {r["request_id"]: r for r in state["running"]}
    assert running[b] == {"request_id": b, "num_prompt_tokens": 23, "num_output_tokens": 1,
                          "num_computed_tokens": 23, "num_cached_tokens": 20, "num_blocks": 6}
    assert state["limits"] == {"max_num_seqs": 2, "max_num_batched_tokens": 512, "enable_chunked_prefill": True}
    json.dumps(state)  # what the endpoint sends

    while engine.has_unfinished_requests():
        engine.step()
        check_pool(engine_state(engine), pool)
    state = engine_state(engine)
    assert state["queues"] == {"waiting": 0, "running": 0} and state["running"] == []
    assert {b["state"] for b in state["pool"]["blocks"]} == {"free", "cached"}
    finished = state["finished"]
    assert [r["request_id"] for r in finished] == sorted([a, b, c], key=lambda i: -engine.requests[i].finish_s)
    for row in finished:
        r = engine.requests[row["request_id"]]
        t = r.token_times_s
        assert row["ttft_ms"] == pytest.approx((t[0] - r.arrival_s) * 1e3, abs=1e-3)
        assert row["tpot_ms"] == pytest.approx((t[-1] - t[0]) / (MAX_NEW - 1) * 1e3, abs=1e-3)
        assert (row["finish_reason"], row["num_output_tokens"]) == ("length", MAX_NEW)


def test_limits_on_blocks_and_finished_rows_and_an_abort_before_any_token(engine):
    pool = engine.cache.allocator
    ids = [engine.add_request(prompt(6, s), SamplingParams(max_new_tokens=1)) for s in range(3)]
    while engine.has_unfinished_requests():
        engine.step()
    waiting = engine.add_request(prompt(6, 9), SamplingParams(max_new_tokens=1))
    engine.abort_request(waiting)

    state = engine_state(engine, max_blocks=3, max_finished=2)
    assert len(state["pool"]["blocks"]) == 3 and state["pool"]["num_blocks"] == pool.num_blocks == 24
    assert state["pool"]["num_cached_blocks"] == pool.num_cached_blocks == 3  # a full block of 4 per prompt
    assert state["pool"]["num_cached_free_blocks"] == 3 > states_count(state["pool"], "cached")  # counted past block 3
    aborted, newest = state["finished"]
    assert aborted == {"request_id": waiting, "finish_reason": "abort", "num_prompt_tokens": 6,
                       "num_output_tokens": 0, "num_cached_tokens": 0, "ttft_ms": None, "tpot_ms": None}
    assert newest["request_id"] in ids and newest["tpot_ms"] is None  # one token: no time per output token


def test_router_serves_the_page_and_the_state_under_the_engines_lock(engine):
    fastapi = pytest.importorskip("fastapi", reason="the server extra is not installed (pip install -e '.[serve]')")
    from fastapi.testclient import TestClient

    from minillm.serving.server.routes import web

    class Stub:  # what the router needs of AsyncEngine: the engine and the lock around its steps
        def __init__(self, engine):
            self.engine, self.lock = engine, threading.Lock()

    app = fastapi.FastAPI()
    app.state.async_engine = Stub(engine)
    app.include_router(web.router)
    a = engine.add_request(prompt(10, 2), SamplingParams(max_new_tokens=2))
    engine.step()
    with TestClient(app) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.text == page_html() and 'id="grid"' in page.text
        assert not re.findall(r'(?:src|href)="(?!data:)', page.text)  # self-contained: nothing fetched from a CDN
        got = client.get("/engine/state").json()
    want = engine_state(engine)
    got["step"].pop("age_ms"), want["step"].pop("age_ms")
    assert got == want and got["running"][0]["request_id"] == a

    app.state.async_engine.lock.acquire()  # a step in progress: the state waits for it
    try:
        with TestClient(app) as client:
            result = {}
            reader = threading.Thread(target=lambda: result.update(r=client.get("/engine/state")))
            reader.start()
            reader.join(0.5)
            assert reader.is_alive() and not result
            app.state.async_engine.lock.release()
            reader.join(10)
            assert result["r"].status_code == 200
    finally:
        if app.state.async_engine.lock.locked():
            app.state.async_engine.lock.release()


def test_a_preemption_shows_in_the_step_and_the_waiting_queue(tiny_model):
    # 6 blocks of 4: two requests of 8 + 12 tokens need 5 blocks each at the end, so the newer is preempted
    engine = LLMEngine(tiny_model("llama_gqa"), num_blocks=6, block_size=B, eos_token_ids=())
    for seed in (0, 1):
        engine.add_request(prompt(8, seed), SamplingParams(max_new_tokens=12))
    seen = []
    while engine.has_unfinished_requests() and not seen:
        engine.step()
        state = engine_state(engine)
        check_pool(state, engine.cache.allocator)
        seen = state["step"]["preempted"]
    (victim,) = seen
    assert seen == list(engine.steps[-1].preempted)
    row = next(r for r in state["waiting"] if r["request_id"] == victim)
    assert row["num_preemptions"] == engine.requests[victim].num_preemptions == 1 and row["num_output_tokens"] > 0
    assert victim not in [r["request_id"] for r in state["running"]]
    assert all(victim not in b.get("request_ids", ()) for b in state["pool"]["blocks"])  # its blocks are gone
