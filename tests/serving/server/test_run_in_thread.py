"""minillm.serving.server.app.run_in_thread: uvicorn in a background thread for notebooks and tests (no model needed)."""

import socket

import pytest

pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
from fastapi import FastAPI  # noqa: E402

from minillm.serving.server.app import run_in_thread  # noqa: E402


def _app(answer: str) -> FastAPI:
    app = FastAPI()
    app.get("/ping")(lambda: {"answer": answer})
    return app


@pytest.mark.server
def test_two_servers_on_free_ports_answer_then_stop():
    with run_in_thread(_app("a"), timeout_s=10) as url_a, run_in_thread(_app("b"), timeout_s=10) as url_b:
        assert url_a != url_b and url_a.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url_a}/ping", timeout=5).json() == {"answer": "a"}
        assert httpx.get(f"{url_b}/ping", timeout=5).json() == {"answer": "b"}
    with pytest.raises(httpx.ConnectError):  # stopped on exit: nothing listens on the port any more
        httpx.get(f"{url_a}/ping", timeout=5)


@pytest.mark.server
def test_a_port_in_use_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port} did not start.*port in use"):
            with run_in_thread(_app("a"), port=port, timeout_s=10):
                pass
