"""From the engine's outputs to the HTTP answer: whole, or streamed as server-sent events.

    AsyncEngine.generate ──RequestOutput──> respond ──┬── stream: false ─> one JSON answer
                                                      └── stream: true  ─> data: {chunk}  (one per step)
                                                                           data: {usage}  (if asked)
                                                                           data: [DONE]

The first output is awaited before any answer starts, so a request the engine refuses (a full
queue, a bad prompt) still gets its HTTP status; after that a stream can only end with an error
event. A client that leaves cancels the coroutine that awaits the engine, which aborts its request.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import StreamingResponse

from . import protocol
from .admission import APIError, ClientDisconnected, param_of
from .async_engine import (EngineDeadError, EngineGoneError, QueueFullError, RequestFailedError,
                           ShuttingDownError)

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


async def respond(outputs, body, reply, request: Request):
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


# -- what the engine raised, as OpenAI's error ---------------------------------------------------

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
    return APIError(400, str(error), param_of(str(error)))


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
