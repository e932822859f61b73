"""OpenAI's two generating endpoints, on the engine thread (AsyncEngine)::

    POST /v1/completions        a prompt (text or token ids) -> its continuation
    POST /v1/chat/completions   messages -> the chat template -> the assistant's answer

Both read the same way, each step a function of admission.py or responses.py:

    read the body ─> check the model ─> the prompt's ids (refused early when they cannot fit)
      ─> max_tokens fit to the context ─> the grammar, the sampling knobs
      ─> the cache point (``cache_control``), with the ``cache_salt``
      ─> AsyncEngine.generate ─> respond (one JSON answer, or server-sent events)

``stream: true`` answers in OpenAI's chunk format, text released as the engine's
:class:`~minillm.stopping.TextStream` lets it go (never half a UTF-8 character or part of a stop string).
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Depends, Request

from .. import protocol
from ..admission import (APIError, cache_point, chat_cache_points, chat_prompt_ids, check_api_key, check_model,
                         check_prompt_ids, check_tool_calls_render, compile_grammar, decode_ids, encode_prompt,
                         fit_max_tokens, log_ignored, read_body, refuse_unfittable, refuse_unfittable_chat,
                         sampling_params)
from ..responses import respond

router = APIRouter(dependencies=[Depends(check_api_key)])


@router.post("/v1/completions", openapi_extra=protocol.openapi_request_body(protocol.CompletionRequest))
async def completions(request: Request):
    state = request.app.state
    body = await _read_request(request, protocol.CompletionRequest)
    prompt_ids = await _prompt_ids(body.prompt, state)
    # max_tokens 0 (with echo): the engine makes its one token, which the answer leaves out (vLLM's way)
    requested = 1 if body.max_tokens == 0 else body.max_tokens
    grammar = await asyncio.to_thread(compile_grammar, body, state.tokenizer, state.async_engine.engine)
    params = sampling_params(body, fit_max_tokens(requested, len(prompt_ids), state.max_model_len),
                             state.generation_defaults, grammar)
    echo_text = None
    if body.echo:
        echo_text = body.prompt if isinstance(body.prompt, str) else decode_ids(state.tokenizer, prompt_ids, "prompt")
    reply = protocol.CompletionReply(f"cmpl-{uuid.uuid4().hex}", state.model_name, tokenizer=state.tokenizer,
                                     echo_text=echo_text, prompt_ids=prompt_ids, num_logprobs=body.logprobs,
                                     generates=body.max_tokens != 0)
    # the prompt's logprobs only when they are shown: they cost a logits row per prompt token
    prompt_logprobs = body.logprobs if body.echo else None
    outputs = state.async_engine.generate(prompt_ids, params, reply.id, logprobs=body.logprobs,
                                          prompt_logprobs=prompt_logprobs, n=body.n, cache_salt=body.cache_salt,
                                          cache_point=cache_point(body.cache_control, len(prompt_ids)))
    return await respond(outputs, body, reply, request)


@router.post("/v1/chat/completions", openapi_extra=protocol.openapi_request_body(protocol.ChatCompletionRequest))
async def chat_completions(request: Request):
    state = request.app.state
    tokenizer, context = state.tokenizer, state.max_model_len
    body = await _read_request(request, protocol.ChatCompletionRequest)
    chat = [m.as_template_message() for m in body.messages]
    check_tool_calls_render(chat, tokenizer)
    refuse_unfittable_chat(chat, context, tokenizer)
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, tokenizer, chat, body.chat_template_kwargs, context)
    max_tokens = fit_max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt_ids), context, "messages")
    grammar = await asyncio.to_thread(compile_grammar, body, tokenizer, state.async_engine.engine)
    params = sampling_params(body, max_tokens, state.generation_defaults, grammar)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    points = await asyncio.to_thread(chat_cache_points, tokenizer, body.messages, chat, prompt_ids,
                                     body.chat_template_kwargs)
    reply = protocol.ChatReply(f"chatcmpl-{uuid.uuid4().hex}", state.model_name, tokenizer)
    outputs = state.async_engine.generate(prompt_ids, params, reply.id, logprobs=logprobs, n=body.n,
                                          cache_salt=body.cache_salt, cache_point=points)
    return await respond(outputs, body, reply, request)


async def _read_request(request: Request, model_class):
    """The body as ``model_class``, naming the served model or none; its ignored fields logged."""
    body = await read_body(request, model_class)
    check_model(body.model, request.app.state.model_name)
    log_ignored(request, body)
    return body


async def _prompt_ids(prompt: str | list[int], state) -> list[int]:
    """A completion's prompt as token ids: a text encoded (in a thread: a long one takes a while), or
    ids checked against the vocabulary; either way APIError 400 when it cannot fit the context."""
    if not isinstance(prompt, str):
        return check_prompt_ids(prompt, state.async_engine.engine.model.config.vocab_size)
    refuse_unfittable(len(prompt), state.max_model_len, state.tokenizer, "prompt")
    return await asyncio.to_thread(encode_prompt, state.tokenizer, prompt, state.max_model_len, "prompt")
