"""Graceful shutdown (issue 31, item 7): on SIGTERM or Ctrl-C the server stops accepting, lets
running requests finish for --shutdown-timeout seconds, then ends each open stream with an error
event and ``[DONE]`` and each waiting request with OpenAI's error JSON, and exits 0 with no
traceback. A client that hangs up mid-body is answered by nothing and logs nothing."""

import json
import logging
import socket
import threading

import httpx
import pytest
from live_server import wait_until

from minillm.serving.engine import LLMEngine
from minillm.serving.server.app import create_app, run_in_thread
from minillm.serving.server.async_engine import AsyncEngine

TIMEOUT_S = 60.0


def stream_lines(url: str, body: dict, lines: list[str], first: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), timeout=TIMEOUT_S) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                first.set()


def post(url: str, body: dict, replies: list) -> None:
    replies.append(httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S))


@pytest.mark.server
def test_shutdown_ends_a_stream_and_a_waiting_request_with_errors(tiny_chat, caplog, capfd):
    model, tokenizer = tiny_chat
    async_engine = AsyncEngine(LLMEngine(model, tokenizer, num_blocks=64, max_num_seqs=1))
    lines, first, replies = [], threading.Event(), []
    long = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
    try:
        # (a drain far shorter than the stream's 400 tokens: ~0.3 s on the developers' machine, the step replayed)
        with caplog.at_level(logging.WARNING), run_in_thread(create_app(async_engine, tokenizer, "m"),
                                                             drain_timeout_s=0.05) as url:
            streaming = threading.Thread(target=stream_lines, args=(url, long, lines, first))
            streaming.start()
            assert first.wait(TIMEOUT_S)
            waiting = threading.Thread(target=post, args=(url, long, replies))
            waiting.start()
            wait_until(lambda: len(async_engine.engine.scheduler.waiting) == 1, TIMEOUT_S)
        streaming.join(TIMEOUT_S)
        waiting.join(TIMEOUT_S)
    finally:
        async_engine.close()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and "shut down" in error["message"]
    [reply] = replies
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutting_down"
    assert not async_engine.engine.has_unfinished_requests()
    logged = caplog.text + capfd.readouterr().err  # uvicorn's own logger writes to stderr, not to the root
    assert "2 request(s) still running" in logged and "Traceback" not in logged and "Cancel" not in logged


@pytest.mark.server
def test_a_request_that_finishes_within_the_timeout_is_answered_in_full(tiny_chat):
    model, tokenizer = tiny_chat
    async_engine = AsyncEngine(LLMEngine(model, tokenizer, num_blocks=64))
    replies, started = [], threading.Event()
    try:
        with run_in_thread(create_app(async_engine, tokenizer, "m"), drain_timeout_s=TIMEOUT_S) as url:
            request = threading.Thread(target=post, args=(url, {"prompt": "Hi", "max_tokens": 40,
                                                                "ignore_eos": True}, replies))
            request.start()
            wait_until(async_engine.engine.has_unfinished_requests, TIMEOUT_S)
        request.join(TIMEOUT_S)
    finally:
        async_engine.close()
    [reply] = replies
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 40


@pytest.mark.server
def test_a_client_that_hangs_up_mid_body_logs_nothing(tiny_chat, caplog, capfd):
    model, tokenizer = tiny_chat
    async_engine = AsyncEngine(LLMEngine(model, tokenizer, num_blocks=64))
    try:
        with caplog.at_level(logging.WARNING), run_in_thread(create_app(async_engine, tokenizer, "m")) as url:
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100000\r\n\r\n{\"prompt\": \"Hi")
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=TIMEOUT_S)
            assert r.status_code == 200
    finally:
        async_engine.close()
    logged = caplog.text + capfd.readouterr().err  # uvicorn's own logger writes to stderr, not to the root
    assert "Traceback" not in logged and "ClientDisconnect" not in logged
