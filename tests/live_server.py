"""A real `minillm serve` app for tests: uvicorn in a thread on 127.0.0.1, a free port
(:func:`minillm.serving.server.app.run_in_thread`, which notebooks use too).

    with live_server(model, tokenizer, num_blocks=64) as url:      # "http://127.0.0.1:PORT"
        httpx.post(f"{url}/v1/completions", json={...})
        app_of(url).state.async_engine.engine.steps                 # the engine behind it

Keyword arguments go to :class:`~minillm.serving.engine.LLMEngine` (``num_blocks``,
``block_size``, ``max_num_seqs``, ...), except ``max_waiting_requests`` (the server's queue
limit) and ``api_key`` (then /v1 needs ``Authorization: Bearer KEY``). On exit the server stops and the engine thread is closed, even after a failure.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import httpx

from minillm.serving.server.app import create_app, run_in_thread
from minillm.serving.server.async_engine import AsyncEngine
from minillm.serving.engine import LLMEngine

_APPS: dict[str, object] = {}  # base URL -> its FastAPI app, while the server runs
STARTUP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(model, tokenizer, model_name: str = "minillm-test", max_waiting_requests: int | None = None,
                api_key: str | None = None, **engine_kwargs):
    """Serve ``model`` on 127.0.0.1 for the ``with`` block; yields the base URL (no trailing slash)."""
    async_engine = AsyncEngine(LLMEngine(model, tokenizer, **engine_kwargs), max_waiting_requests)
    try:
        app = create_app(async_engine, tokenizer, model_name, api_key=api_key)
        with run_in_thread(app, "127.0.0.1", timeout_s=STARTUP_TIMEOUT_S) as url:
            _APPS[url] = app
            try:
                yield url
            finally:
                _APPS.pop(url, None)
    finally:
        async_engine.close()


def app_of(url: str):
    """The FastAPI app behind a running ``live_server`` URL (``.state.async_engine``, ``.state.metrics``)."""
    return _APPS[url]


def wait_until(predicate, timeout_s: float = 30.0, poll_s: float = 0.01) -> None:
    """Poll ``predicate()`` until it is true; AssertionError after ``timeout_s`` (bounded waits in tests)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {getattr(predicate, '__name__', predicate)}")
        time.sleep(poll_s)


def start_serve(folder, *options: str, kv_cache_memory: str = "8MiB", timeout_s: float = 60.0
                ) -> tuple[subprocess.Popen, str]:
    """`minillm serve` on a free port as a subprocess, once its /health answers: (process, base URL).
    Its stdout and stderr are pipes (``communicate()`` reads them)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", str(folder), "--port", str(port),
                               "--kv-cache-memory", kv_cache_memory, *options],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def up():
        assert server.poll() is None, server.stderr.read()
        try:
            return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, timeout_s, poll_s=0.2)
    except BaseException:
        server.kill()
        raise
    return server, url
