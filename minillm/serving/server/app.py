"""An OpenAI-compatible HTTP server on the batching engine (vLLM's ``vllm serve``, in small).

    POST /v1/completions        a prompt (text or token ids) -> its continuation
    POST /v1/chat/completions   messages -> the chat template -> the assistant's answer
    GET  /v1/models             the one model served
    GET  /v1/models/{id}        that model (OpenAI's model object); 404 for another id
    POST /tokenize              vLLM's: a prompt or messages -> token ids, count, max_model_len
    POST /detokenize            vLLM's: token ids -> text
    GET  /tokenizer_info        vLLM's: the special tokens and chat template (lm-eval's remote tokenizer)
    GET  /health                200 while the engine thread is alive and can step (HEAD too: no body);
                                503 while its last step failed with a failure no request owned;
                                503 once it stopped or lost a tensor-parallel rank (``minillm serve`` then
                                exits, unless --keep-alive-on-engine-death)
    GET  /metrics               Prometheus text: vLLM's metric names under ``minillm:``
    GET  /                      the live view of the engine (web_view.py)

Each HTTP request is a coroutine; all of them feed one :class:`AsyncEngine`, whose thread
steps the engine and batches whatever requests are in flight. ``stream: true`` answers with
server-sent events in OpenAI's chunk format (``data: {...}`` lines, then ``data: [DONE]``).
Text is streamed as the engine releases it (:class:`~minillm.stopping.TextStream`), so a
chunk never splits a UTF-8 character or shows part of a stop string.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import threading
import time
import uuid

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ...generation_config import generation_config_of
from ...sampling import SamplingParams
from ...malloc_policy import give_back_freed_memory
from ...tokenizer import NORMALIZER_SLACK
from . import protocol
from .async_engine import (AsyncEngine, EngineDeadError, EngineGoneError, QueueFullError, RequestFailedError,
                           ShuttingDownError)
from .metrics import ServerMetrics
from .web_view import router as web_view_router

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
MAX_BODY_BYTES = 32 * 2**20  # 8,192 token ids as JSON take about 50 KB


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def create_app(async_engine: AsyncEngine, tokenizer, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``async_engine``'s model under the name ``model_name``.

    Args:
        async_engine: the engine in its thread (its ``engine`` must have been built with no
            other user); ``app.state.async_engine`` holds it, for routers added later.
        tokenizer: the model's :class:`~minillm.tokenizer.Tokenizer` (text in, text out,
            the chat template).
        model_name: what /v1/models lists and requests must name (or leave out).
        api_key: if given, every /v1 request must send ``Authorization: Bearer <api_key>``
            (401 otherwise), as vLLM's ``--api-key``; /health, /metrics and the web view stay open.

    The app's metrics live in their own Prometheus registry (``app.state.metrics``), so several
    apps in one process (tests) do not collide.
    """
    if async_engine.engine.tokenizer is None:
        raise ValueError("the engine needs the tokenizer to stream text: LLMEngine(model, tokenizer, ...)")
    app = FastAPI(title="minillm", description="an OpenAI-compatible server on minillm's batching engine")
    _describe_request_bodies(app)
    app.state.async_engine, app.state.tokenizer, app.state.model_name = async_engine, tokenizer, model_name
    app.state.metrics = metrics = ServerMetrics(async_engine)
    async_engine.on_finished = metrics.observe_finished
    app.include_router(web_view_router)  # GET / (the live engine view) and GET /engine/state
    model = async_engine.engine.model
    defaults, created_s = generation_config_of(model).defaults, protocol.now_s()
    context = max_model_len(async_engine.engine)

    expected_auth = f"Bearer {api_key}".encode()

    def check_api_key(request: Request) -> None:
        """A dependency of the /v1 routes (not a middleware: Starlette's would hide disconnects)."""
        if api_key is not None and not secrets.compare_digest(
                request.headers.get("authorization", "").encode(), expected_auth):
            raise APIError(401, "a missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                                "(the server's --api-key)", code="invalid_api_key")

    v1 = dict(dependencies=[Depends(check_api_key)])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(protocol.error_body(error.status, error.message, error.param, error.code), error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:  # 404, 405
        message = f"{request.method} {request.url.path}: {error.detail}; the API is under /v1 (GET /v1/models)"
        return JSONResponse(protocol.error_body(error.status_code, message), error.status_code)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, error: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:  # a bug: say so, keep serving
        return JSONResponse(protocol.error_body(500, f"internal error: {type(error).__name__}: {error}"), 500)

    @app.head("/health", operation_id="health_head")  # one route per method: one OpenAPI operation id each
    @app.get("/health", operation_id="health")
    async def health(request: Request):
        if async_engine.lost is not None:  # a tensor-parallel rank died: every step would fail
            raise APIError(503, f"the engine cannot run: {async_engine.lost}; restart the server",
                           code="engine_dead")
        if not async_engine.is_alive():
            raise APIError(503, "the engine thread has stopped; restart the server")
        if async_engine.step_failure is not None:  # no request owned it; the next step that runs clears it
            raise APIError(503, f"the engine's last step failed ({async_engine.step_failure}); the requests in it "
                                "were ended, new ones are taken")
        return Response(status_code=200) if request.method == "HEAD" else {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        body = await asyncio.to_thread(metrics.exposition)  # the gauges wait for the engine's lock
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    model_card = {"id": model_name, "object": "model", "created": created_s, "owned_by": "minillm",
                  "max_model_len": context}

    @app.get("/v1/models", **v1)
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}", **v1)
    async def model_by_id(model_id: str):
        _check_model(model_id, model_name)
        return model_card

    @app.post("/v1/completions", **v1, openapi_extra=protocol.openapi_request_body(protocol.CompletionRequest))
    async def completions(request: Request):
        body = await _parse(request, protocol.CompletionRequest)
        _check_model(body.model, model_name)
        _log_ignored(request, body)
        if isinstance(body.prompt, str):
            _refuse_unfittable(len(body.prompt), context, tokenizer, "prompt")
            prompt_ids = await asyncio.to_thread(_encode_prompt, tokenizer, body.prompt, context, "prompt")
        else:
            prompt_ids = _check_prompt_ids(body.prompt, model.config.vocab_size)
        # max_tokens 0 (with echo): the engine makes its one token, which the answer leaves out (vLLM's way)
        requested = 1 if body.max_tokens == 0 else body.max_tokens
        grammar = await asyncio.to_thread(_grammar, body, tokenizer, async_engine.engine)
        params = _sampling_params(body, _max_tokens(requested, len(prompt_ids), context), defaults, grammar)
        echo_text = None
        if body.echo:
            echo_text = body.prompt if isinstance(body.prompt, str) else _detokenize(tokenizer, prompt_ids, "prompt")
        reply = protocol.CompletionReply(f"cmpl-{uuid.uuid4().hex}", model_name, tokenizer=tokenizer,
                                         echo_text=echo_text, prompt_ids=prompt_ids, num_logprobs=body.logprobs,
                                         generates=body.max_tokens != 0)
        # the prompt's logprobs only when they are shown: they cost a logits row per prompt token
        prompt_logprobs = body.logprobs if body.echo else None
        outputs = async_engine.generate(prompt_ids, params, reply.id, logprobs=body.logprobs,
                                        prompt_logprobs=prompt_logprobs, n=body.n)
        return await _respond(outputs, body, reply, request)

    @app.post("/v1/chat/completions", **v1, openapi_extra=protocol.openapi_request_body(protocol.ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await _parse(request, protocol.ChatCompletionRequest)
        _check_model(body.model, model_name)
        _log_ignored(request, body)
        chat = [m.as_template_message() for m in body.messages]
        _check_tool_calls_render(chat, tokenizer)
        _refuse_unfittable_chat(chat, context, tokenizer)
        prompt_ids = await asyncio.to_thread(_chat_prompt_ids, tokenizer, chat, body.chat_template_kwargs, context)
        max_tokens = _max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt_ids), context, "messages")
        grammar = await asyncio.to_thread(_grammar, body, tokenizer, async_engine.engine)
        params = _sampling_params(body, max_tokens, defaults, grammar)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        reply = protocol.ChatReply(f"chatcmpl-{uuid.uuid4().hex}", model_name, tokenizer)
        outputs = async_engine.generate(prompt_ids, params, reply.id, logprobs=logprobs, n=body.n)
        return await _respond(outputs, body, reply, request)

    @app.post("/tokenize", **v1, openapi_extra=protocol.openapi_request_body(protocol.TokenizeRequest))
    async def tokenize(request: Request):
        """vLLM's /tokenize: ``{"tokens", "count", "max_model_len", "token_strs"}``."""
        body = await _parse(request, protocol.TokenizeRequest)
        _check_model(body.model, model_name)
        if body.prompt is not None:
            _refuse_unfittable(len(body.prompt), context, tokenizer, "prompt")
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, special)
        else:
            chat = [m.as_template_message() for m in body.messages]
            _check_tool_calls_render(chat, tokenizer)
            _refuse_unfittable_chat(chat, context, tokenizer)
            try:  # in a thread, as the chat routes do: a long chat renders for a while
                text = await asyncio.to_thread(tokenizer.apply_chat_template, chat,
                                               add_generation_prompt=body.add_generation_prompt,
                                               **(body.chat_template_kwargs or {}))
            except ValueError as error:
                raise APIError(400, str(error), "messages") from None
            ids = await asyncio.to_thread(tokenizer.encode, text, bool(body.add_special_tokens))
        return {"count": len(ids), "max_model_len": context, "tokens": ids,
                "token_strs": tokenizer.token_strings(ids) if body.return_token_strs else None}

    @app.post("/detokenize", **v1, openapi_extra=protocol.openapi_request_body(protocol.DetokenizeRequest))
    async def detokenize(request: Request):
        """vLLM's /detokenize: ``{"prompt": text}``, special tokens written out."""
        body = await _parse(request, protocol.DetokenizeRequest)
        _check_model(body.model, model_name)
        return {"prompt": _detokenize(tokenizer, body.tokens, "tokens")}

    special = {name: tokenizer.special_tokens.get(name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    if special["eos_token"] is None and tokenizer.eos_token_id is not None:
        special["eos_token"] = tokenizer.id_to_token(tokenizer.eos_token_id)
    tokenizer_info = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                      "chat_template": tokenizer.chat_template, "model_max_length": context}

    @app.get("/tokenizer_info", **v1)
    async def get_tokenizer_info():
        """vLLM's /tokenizer_info (its --enable-tokenizer-info-endpoint): what lm-eval's remote
        tokenizer reads (the special tokens, the chat template)."""
        return tokenizer_info

    return app


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


def _detokenize(tokenizer, ids: list[int], param: str) -> str:
    """The text of ``ids``, special tokens kept (vLLM's /detokenize and echo); APIError 400 for an id
    outside the vocabulary."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except ValueError as error:
        raise APIError(400, str(error), param) from None


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


async def _respond(outputs, body, reply, request: Request):
    """Await the first output (errors of the request still become HTTP statuses), then answer
    with the whole completion, or stream it as server-sent events.

    ``n`` > 1 (parallel sampling): one reply per choice renders it (``reply.for_choice(i)``), the
    engine's outputs say which (``out.index``), and ``usage`` counts the prompt once."""
    replies = [reply] if body.n == 1 else [reply.for_choice(i) for i in range(body.n)]
    first = await _until_disconnect(_next(outputs, body), request)
    if not body.stream:
        if body.n > 1:
            return protocol.response_n(replies, await _until_disconnect(_finals(first, outputs, body), request))
        last = first if first.finished else await _until_disconnect(_last(outputs, body), request)
        return reply.response(last)
    usage_mode = body.stream_options.usage_mode if body.stream_options is not None else None
    return StreamingResponse(_events(first, outputs, replies, usage_mode, body), media_type="text/event-stream")


async def _events(first, outputs, replies, usage_mode: str | None, body):
    """The SSE stream: one chunk per generated token, the usage chunk if asked, ``[DONE]``.

    With n > 1 the choices' chunks interleave as the engine steps, each with its ``index``, and
    each choice's last chunk carries its ``finish_reason``; ``[DONE]`` follows the last choice.
    The client going away cancels this generator (Starlette listens for the disconnect), and
    the cancellation reaches ``AsyncEngine.generate``, which aborts the request.
    """
    def event(data: dict) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def with_total_usage(chunk: dict) -> dict:  # n > 1: the prompt once, every choice's tokens so far
        if len(replies) > 1:
            chunk["usage"] = protocol.sum_usage([replies[i].usage_chunk(o)["usage"] for i, o in latest.items()])
        return chunk

    for reply in replies:
        for chunk in reply.first_chunks(first, usage_mode):
            yield event(chunk)
    out, latest = first, {}
    try:
        while True:
            latest[out.index] = out
            chunk = replies[out.index].chunk(out, usage_mode)
            yield event(with_total_usage(chunk) if usage_mode == "every" else chunk)
            if len(latest) == len(replies) and all(o.finished for o in latest.values()):
                break
            out = await outputs.__anext__()
    except _ENGINE_ERRORS as error:
        api_error = _engine_error(error, body)
        yield event(protocol.error_body(api_error.status, api_error.message, api_error.param, api_error.code))
    else:
        if usage_mode is not None:
            yield event(with_total_usage(replies[0].usage_chunk(out)))
    yield "data: [DONE]\n\n"


async def _next(outputs, body):
    try:
        return await outputs.__anext__()
    except _ENGINE_ERRORS as error:
        raise _engine_error(error, body) from None


async def _last(outputs, body):
    last = None
    try:
        async for last in outputs:
            pass
    except _ENGINE_ERRORS as error:
        raise _engine_error(error, body) from None
    return last


async def _finals(first, outputs, body) -> list:
    """The last output of each of the body's n choices, in index order."""
    finals = {first.index: first} if first.finished else {}
    try:
        async for out in outputs:
            if out.finished:
                finals[out.index] = out
    except _ENGINE_ERRORS as error:
        raise _engine_error(error, body) from None
    return [finals[i] for i in range(body.n)]


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready; its request was aborted."""


async def _until_disconnect(coroutine, request: Request):
    """Await ``coroutine``, polling the connection; a client gone cancels it (which aborts its
    request in the engine) and raises ClientDisconnected."""
    task = asyncio.ensure_future(coroutine)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientDisconnected()
    except asyncio.CancelledError:
        task.cancel()
        raise


def _check_tool_calls_render(chat: list[dict], tokenizer) -> None:
    """APIError 400 when an assistant message carries tool_calls that the model's chat template
    never reads (it would drop them, and the model would answer a different conversation)."""
    with_calls = [i for i, message in enumerate(chat) if message.get("tool_calls")]
    if with_calls and "tool_calls" not in str(tokenizer.chat_template):
        raise APIError(400, f"messages[{with_calls[0]}] carries tool_calls, but this model's chat template does not "
                            "render tool calls; send the calls' results as text content instead",
                       f"messages.{with_calls[0]}.tool_calls")


def _chat_prompt_ids(tokenizer, chat: list[dict], template_kwargs: dict | None, context: int) -> list[int]:
    """The chat template applied (with the assistant's turn opened, and the request's
    ``chat_template_kwargs``), then encoded (the template wrote the special tokens); APIError 400 when
    the template refuses the chat, or when the prompt cannot fit the ``context`` (:func:`_encode_prompt`)."""
    try:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, **(template_kwargs or {}))
    except ValueError as error:
        raise APIError(400, str(error), "messages") from None
    return _encode_prompt(tokenizer, text, context, "messages", add_special_tokens=False)


async def _parse(request: Request, model_class):
    """The body as ``model_class``; APIError 400 for non-UTF-8, bad JSON, wrong types or values,
    413 for a body over MAX_BODY_BYTES (read no further: the server's memory is not the client's)."""
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over {MAX_BODY_BYTES:,} bytes; a prompt the model's "
                                    "context can hold is far smaller")
    except ClientDisconnect:  # hung up mid-body: nobody to answer
        raise ClientDisconnected() from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, f"the body is not UTF-8 text (byte {error.start}); send JSON encoded as UTF-8") from None
    try:
        return model_class.model_validate_json(text)
    except ValidationError as error:
        message, param = protocol.validation_message(error)
        raise APIError(400, message, param) from None


def _log_ignored(request: Request, body) -> None:
    """One log line naming the request's fields that change nothing (vLLM warns the same way)."""
    if ignored := body.ignored_fields():
        logger.warning("%s %s: ignored fields (accepted as OpenAI's clients send them; they change nothing "
                       "here): %s", request.method, request.url.path, ", ".join(ignored))


def _check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r} (GET /v1/models)",
                       "model", "model_not_found")


def max_model_len(engine) -> int:
    """The longest request (prompt + output tokens) this server takes: the model's context, or
    fewer when the whole KV cache pool holds fewer positions. vLLM refuses to start then
    ("max seq len is larger than the KV cache can store"); this server serves the shorter
    requests, says so in ``GET /v1/models`` (``max_model_len``), and refuses the longer ones
    up front instead of cutting them short."""
    pool = engine.cache.allocator
    return min(engine.model.config.max_seq_len, pool.num_blocks * pool.block_size)


def _refuse_unfittable(n_chars: int, context: int, tokenizer, param: str) -> None:
    """APIError 400 for a text that cannot fit the context whatever its tokens, decided from its
    length alone: tokenising megabytes only to refuse them would hold up every other request."""
    limit = context * tokenizer.max_token_chars * NORMALIZER_SLACK
    if n_chars > limit:
        raise APIError(400, f"the prompt is {n_chars:,} characters, more than this server's maximum context "
                            f"length of {context} tokens can hold (a token spells at most "
                            f"{tokenizer.max_token_chars} characters); shorten the prompt", param,
                       "context_length_exceeded")


def _refuse_unfittable_chat(chat: list[dict], context: int, tokenizer) -> None:
    """:func:`_refuse_unfittable` for a chat: its contents' characters, and its number of messages, which
    may not exceed the context's tokens (a chat template writes at least a role marker per message, so
    a million empty messages cannot fit, and rendering them alone would hold up the server for seconds)."""
    if len(chat) > context:
        raise APIError(400, f"the chat has {len(chat):,} messages, more than this server's maximum context length "
                            f"of {context} tokens can hold (each message takes at least one token); send fewer",
                       "messages", "context_length_exceeded")
    _refuse_unfittable(sum(len(m.get("content") or "") for m in chat), context, tokenizer, "messages")


def _check_prompt_ids(ids: list[int], vocab: int) -> list[int]:
    """``ids``, or APIError 400 naming the prompt for an id outside [0, vocab): checked here, since
    the engine's own check first makes a tensor, which an id past 64 bits fails in words about tensors."""
    bad = next((i for i, token_id in enumerate(ids) if not 0 <= token_id < vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt ids must be in [0, {vocab}) (the vocabulary); item {bad} is {ids[bad]}",
                       "prompt")
    return list(ids)


# After tokenising more than this (a MiB of characters: a few hundred thousand tokens, far past
# any context), glibc is told to give the tokenizer's memory back.
TRIM_AFTER_CHARS = 2**20


def _encode_prompt(tokenizer, text: str, context: int, param: str, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids; APIError 400 naming ``param`` as soon as a prefix of the text shows
    that it holds ``context`` tokens or more (Tokenizer.tokens_at_least): a prompt of megabytes
    is refused in a fraction of a second, without tokenising it whole."""
    try:
        at_least = tokenizer.tokens_at_least(text, context)
        if at_least >= context:
            raise APIError(400, f"the prompt is {len(text):,} characters, at least {at_least:,} tokens, but this "
                                f"server's maximum context length is {context} tokens (prompt and output together"
                                f"{_POOL_NOTE}); shorten the prompt", param, "context_length_exceeded")
        return tokenizer.encode(text, add_special_tokens)
    finally:
        if len(text) > TRIM_AFTER_CHARS:  # the tokenizer's buffers for it: the malloc policy would keep them
            give_back_freed_memory()


def _max_tokens(requested: int | None, prompt_len: int, context: int, prompt_param: str = "prompt") -> int:
    """``requested``, or the rest of the context; APIError 400 when prompt and output exceed the
    context (OpenAI's and vLLM's rule, with their numbers in the message). ``prompt_param``: the
    field that holds the prompt ("messages" for a chat)."""
    if prompt_len >= context:
        raise APIError(400, f"the prompt is {prompt_len} tokens but this server's maximum context length is "
                            f"{context} tokens (prompt and output together{_POOL_NOTE}); shorten the prompt",
                       prompt_param, "context_length_exceeded")
    if requested is None:
        return context - prompt_len
    if prompt_len + requested > context:
        raise APIError(400, f"this server's maximum context length is {context} tokens{_POOL_NOTE}, but "
                            f"{prompt_len + requested} were requested ({prompt_len} in the prompt, {requested} for "
                            "the completion); lower max_tokens or shorten the prompt", "max_tokens",
                       "context_length_exceeded")
    return requested


_POOL_NOTE = "; the model's context or the KV cache pool's positions, whichever is less: GET /v1/models"


def _grammar(body, tokenizer, engine):
    """The request's structured-output constraint (``response_format``, ``structured_outputs``,
    ``guided_*``) compiled by minillm.structured, or None; a 400 naming the field when it cannot be.
    (Run in a thread: the first one reads the vocabulary into the grammar library, about a second.)"""
    fields = body.structured_fields()
    if all(value is None for value in fields.values()):
        return None
    from ...structured import grammar_from_request  # the grammar library, only for requests that ask

    try:
        return grammar_from_request(tokenizer, engine.model.config.vocab_size, sorted(engine.eos_token_ids), **fields)
    except ImportError as error:
        raise APIError(400, f"structured output is not available on this server: {error}") from None
    except ValueError as error:  # "<field>[.<key>]: why", or two constraints at once
        field = str(error).split(":")[0].split(".")[0]
        raise APIError(400, str(error), field if field in fields else None) from None


def _sampling_params(body, max_tokens: int, defaults: dict, grammar=None) -> SamplingParams:
    """The request's knobs; a knob it leaves out takes the checkpoint's default
    (generation_config.json, as vLLM's ``--generation-config auto``), else OpenAI's. ``grammar``:
    the structured-output constraint (:func:`_grammar`); ``logit_bias``'s token id strings become ints."""
    def knob(name, fallback):
        value = getattr(body, name)
        return value if value is not None else defaults.get(name, fallback)

    try:
        return SamplingParams(
            temperature=knob("temperature", protocol.OPENAI_DEFAULT_TEMPERATURE), top_p=knob("top_p", 1.0),
            top_k=knob("top_k", 0), min_p=knob("min_p", 0.0), repetition_penalty=knob("repetition_penalty", 1.0),
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            seed=body.seed, max_new_tokens=max_tokens, stop=body.stop or (), ignore_eos=body.ignore_eos,
            logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()} or None, allowed_tokens=grammar)
    except ValueError as error:  # SamplingParams' messages start with the knob's name
        name = {"max_new_tokens": "max_tokens"}.get(str(error).split()[0], str(error).split()[0])
        raise APIError(400, str(error), name if name in type(body).model_fields else _param_of(str(error))) from None


_ENGINE_ERRORS = (QueueFullError, EngineDeadError, RequestFailedError, ValueError)


def _engine_error(error: Exception, body=None) -> APIError:
    """What the engine raised for a request, as its HTTP status and OpenAI's error fields."""
    if isinstance(error, RequestFailedError):
        return _request_failed(error, body)
    if isinstance(error, QueueFullError):
        return APIError(503, str(error), code="queue_full")
    if isinstance(error, ShuttingDownError):
        return APIError(503, str(error), code="server_shutting_down")
    if isinstance(error, EngineGoneError):
        return APIError(503, str(error), code="engine_dead")
    if isinstance(error, EngineDeadError):
        return APIError(500, str(error))
    return APIError(400, str(error), _param_of(str(error)))


def _request_failed(error: RequestFailedError, body) -> APIError:
    """A part of this request failed during a step, and it alone ended: its structured-output
    constraint is the client's (400, naming the field that asked for it); a NaN logits row, its
    sampling or its text are the server's (500), either way with code "request_failed"."""
    if error.part == "allowed_tokens":
        fields = body.structured_fields() if body is not None else {}
        field = next((name for name, value in fields.items()
                      if value is not None and value != {"type": "text"}), None)  # "text" asks for no constraint
        return APIError(400, f"{error} (the structured output constraint could not go on; simplify it)", field,
                        "request_failed")
    return APIError(500, str(error), code="request_failed")


# the engine's own checks (Engine.add_request) as the request field they are about: the 400's "param"
_ENGINE_PARAMS = (("n (sequences per request)", "n"), ("prompt ids must be in", "prompt"),
                  ("logit_bias", "logit_bias"))


def _param_of(message: str) -> str | None:
    return next((param for start, param in _ENGINE_PARAMS if message.startswith(start)), None)
