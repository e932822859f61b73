"""An OpenAI-compatible HTTP server on the batching engine (vLLM's ``vllm serve``, in small).

    POST /v1/completions        a prompt (text or token ids) -> its continuation         routes/completions.py
    POST /v1/chat/completions   messages -> the chat template -> the assistant's answer
    GET  /v1/models             the one model served                                     routes/models.py
    GET  /v1/models/{id}        that model (OpenAI's model object); 404 for another id
    POST /tokenize              vLLM's: a prompt or messages -> token ids, count, max_model_len   routes/tokenize.py
    POST /detokenize            vLLM's: token ids -> text
    GET  /tokenizer_info        vLLM's: the special tokens and chat template (lm-eval's remote tokenizer)
    GET  /health                200 while the engine thread is alive and can step (HEAD too: no body);  routes/health.py
                                503 while its last step failed with a failure no request owned;
                                503 once it stopped or lost a tensor-parallel rank (``minillm serve`` then
                                exits, unless --keep-alive-on-engine-death)
    GET  /metrics               Prometheus text: vLLM's metric names under ``minillm:``
    GET  /                      the live view of the engine                              routes/web.py

Each HTTP request is a coroutine; all of them feed one :class:`AsyncEngine`, whose thread
steps the engine and batches whatever requests are in flight. ``stream: true`` answers with
server-sent events in OpenAI's chunk format (``data: {...}`` lines, then ``data: [DONE]``).
Text is streamed as the engine releases it (:class:`~minillm.stopping.TextStream`), so a
chunk never splits a UTF-8 character or shows part of a stop string.

This module assembles the app (:func:`create_app`: the shared state, the routers, the error
handlers) and serves it (:func:`serve` for ``minillm serve``, :func:`run_in_thread` for notebooks
and tests), both with a graceful shutdown (:class:`DrainingServer`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...generation_config import generation_config_of
from . import protocol
from .admission import APIError, ClientDisconnected
from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .routes import completions, health, models, tokenize, web

logger = logging.getLogger(__name__)


def create_app(async_engine: AsyncEngine, tokenizer, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``async_engine``'s model under the name ``model_name``.

    Args:
        async_engine: the engine in its thread (its ``engine`` must have been built with no
            other user).
        tokenizer: the model's :class:`~minillm.tokenizer.Tokenizer` (text in, text out,
            the chat template).
        model_name: what /v1/models lists and requests must name (or leave out).
        api_key: if given, every /v1 request must send ``Authorization: Bearer <api_key>``
            (401 otherwise), as vLLM's ``--api-key``; /health, /metrics and the web view stay open.

    What the handlers share is ``app.state`` (routes/ reads it as ``request.app.state``):
    ``async_engine``, ``tokenizer``, ``model_name``, ``api_key``, ``max_model_len`` (:func:`max_model_len`),
    ``generation_defaults`` (the checkpoint's generation_config.json), ``created_s`` (the model object's
    ``created``) and ``metrics``: the app's metrics, in their own Prometheus registry, so several apps
    in one process (tests) do not collide.
    """
    if async_engine.engine.tokenizer is None:
        raise ValueError("the engine needs the tokenizer to stream text: LLMEngine(model, tokenizer, ...)")
    app = FastAPI(title="minillm", description="an OpenAI-compatible server on minillm's batching engine",
                  exception_handlers=EXCEPTION_HANDLERS)
    state = app.state
    state.async_engine, state.tokenizer, state.model_name, state.api_key = async_engine, tokenizer, model_name, api_key
    state.max_model_len = max_model_len(async_engine.engine)
    state.generation_defaults = generation_config_of(async_engine.engine.model).defaults
    state.created_s = protocol.now_s()
    state.metrics = ServerMetrics(async_engine)
    async_engine.on_finished = state.metrics.observe_finished
    for router in (web.router, health.router, models.router, completions.router, tokenize.router):
        app.include_router(router)
    _describe_request_bodies(app)
    return app


def max_model_len(engine) -> int:
    """The longest request (prompt + output tokens) this server takes: the model's context, or
    fewer when the whole KV cache pool holds fewer positions. vLLM refuses to start then
    ("max seq len is larger than the KV cache can store"); this server serves the shorter
    requests, says so in ``GET /v1/models`` (``max_model_len``), and refuses the longer ones
    up front instead of cutting them short."""
    pool = engine.cache.allocator
    return min(engine.model.config.max_seq_len, pool.num_blocks * pool.block_size)


# -- errors, as OpenAI's error JSON ----------------------------------------------------------


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(protocol.error_body(error.status, error.message, error.param, error.code), error.status)


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:  # 404, 405
    message = f"{request.method} {request.url.path}: {error.detail}; the API is under /v1 (GET /v1/models)"
    return JSONResponse(protocol.error_body(error.status_code, message), error.status_code)


async def _gone(request: Request, error: ClientDisconnected) -> Response:
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def _unexpected(request: Request, error: Exception) -> JSONResponse:  # a bug: say so, keep serving
    return JSONResponse(protocol.error_body(500, f"internal error: {type(error).__name__}: {error}"), 500)


EXCEPTION_HANDLERS = {APIError: _api_error, StarletteHTTPException: _http_error, ClientDisconnected: _gone,
                      Exception: _unexpected}


def _describe_request_bodies(app: FastAPI) -> None:
    """/openapi.json (and /docs) with the nested models of the request bodies in
    ``components.schemas``, where the routes' ``openapi_extra`` (protocol.openapi_request_body)
    points: FastAPI generates the rest of the document (FastAPI's "Extending OpenAPI")."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schemas = generate().setdefault("components", {}).setdefault("schemas", {})
            schemas.update(protocol.openapi_components(*_REQUEST_BODIES))
        return app.openapi_schema

    app.openapi = openapi


_REQUEST_BODIES = (protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.TokenizeRequest,
                   protocol.DetokenizeRequest)


# -- serving it: uvicorn, with a graceful shutdown -------------------------------------------


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful shutdown for minillm's requests.

    On SIGTERM or Ctrl-C (or ``should_exit``) it stops accepting connections, refuses new
    requests on open ones (503), lets running requests finish for up to ``drain_timeout_s``
    seconds, then ends each one left with OpenAI's error (a stream: an error event and
    ``[DONE]``), so that uvicorn never has to cancel a handler mid-response.
    """

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, drain_timeout_s: float):
        super().__init__(config)
        self.async_engine, self.drain_timeout_s = async_engine, drain_timeout_s

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()  # stop accepting now; uvicorn's own shutdown closes them again, harmlessly
        ended = await self.async_engine.drain(self.drain_timeout_s)
        if ended:
            logger.warning("shutting down: %d request(s) still running after %g s were ended with an error",
                           ended, self.drain_timeout_s)
        await super().shutdown(sockets)

    def stop_after(self, delay_s: float) -> None:
        """Shut down as on SIGTERM ``delay_s`` seconds from now; any thread may call it (a timer sets
        ``should_exit``, which uvicorn's main loop reads every 0.1 s)."""
        timer = threading.Timer(delay_s, setattr, (self, "should_exit", True))
        timer.daemon = True
        timer.start()


def serve(app: FastAPI, host: str, port: int, drain_timeout_s: float, exit_on_lost_s: float | None = None) -> None:
    """Serve ``app`` until SIGTERM or Ctrl-C, then shut down gracefully (:class:`DrainingServer`)
    and return: a shutdown asked for is a normal end (exit status 0).

    ``exit_on_lost_s``: once the engine is lost (``AsyncEngine.on_lost``: a tensor-parallel rank died), shut
    down as on SIGTERM this many seconds later, new requests answered 503 meanwhile; the caller tells this end
    by ``async_engine.lost``. None: keep answering 503 until stopped."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=_AFTER_DRAIN_S, http=JSONErrorsHTTPProtocol)
    # uvicorn raises the signal it stopped on again once it is done; caught here, not fatal
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        server = DrainingServer(config, app.state.async_engine, drain_timeout_s)
        if exit_on_lost_s is not None:
            app.state.async_engine.on_lost = lambda reason: server.stop_after(exit_on_lost_s)
        server.run()
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Stopped(Exception):
    """SIGTERM, raised again by uvicorn after its shutdown."""


def _raise_stopped(signum, frame) -> None:
    raise _Stopped()


# After the drain every response is complete: this bounds uvicorn's own wait for their sockets.
_AFTER_DRAIN_S = 5


@contextlib.contextmanager
def run_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                  drain_timeout_s: float = 0.0):
    """Serve ``app`` with uvicorn in a background thread for a ``with`` block; yields the base URL.

        with run_in_thread(create_app(async_engine, tok, "smollm2")) as url:   # "http://127.0.0.1:PORT"
            OpenAI(base_url=f"{url}/v1", api_key="unused").completions.create(...)
        async_engine.close()                                                   # the engine is the caller's

    For notebooks and tests, where ``minillm serve`` would block the kernel. ``port=0`` lets the
    OS pick a free port (read back from the bound socket, so there is no race with another
    server). On exit the server stops as on SIGTERM (:class:`DrainingServer`): running requests
    get ``drain_timeout_s`` to finish, then end with an error.
    Raises RuntimeError if the server has not started (a port in use, a bad host) within ``timeout_s``.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=int(timeout_s), http=JSONErrorsHTTPProtocol)
    engine = getattr(app.state, "async_engine", None)  # any ASGI app may be served here (tests)
    server = DrainingServer(config, engine, drain_timeout_s) if engine is not None else uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="minillm-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:  # uvicorn sets it once the socket listens
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {host}:{port} did not start within {timeout_s} s "
                                   "(is the port in use?)")
            time.sleep(0.02)
        bound_port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s + drain_timeout_s)


class JSONErrorsHTTPProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools' where installed, else h11's) answering a request it
    cannot parse (a bad request line, a header h11 refuses, a wrong Content-Length) with OpenAI's
    error JSON instead of uvicorn's plain text. Such a request never reaches the app, so its
    exception handlers cannot answer it. ``uvicorn.Config(app, http=JSONErrorsHTTPProtocol)``.
    """

    def send_400_response(self, msg: str) -> None:  # both of uvicorn's protocols call it, then nothing else
        body = json.dumps(protocol.error_body(400, "the HTTP request is malformed (the server could not parse its "
                                                   "request line or headers); send HTTP/1.1")).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()
