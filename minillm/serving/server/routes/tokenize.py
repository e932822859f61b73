"""vLLM's tokenizer endpoints (what lm-eval's remote tokenizer and clients counting tokens call)::

    POST /tokenize         a prompt or messages -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize       token ids -> {"prompt": text}, special tokens written out
    GET  /tokenizer_info   the special tokens and the chat template

They sit behind the API key as the /v1 routes do, and refuse a text that cannot fit the
context as the completion routes do (admission.py).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from .. import protocol
from ..admission import (APIError, check_api_key, check_model, check_tool_calls_render, decode_ids, read_body,
                         refuse_unfittable, refuse_unfittable_chat)

router = APIRouter(dependencies=[Depends(check_api_key)])


@router.post("/tokenize", openapi_extra=protocol.openapi_request_body(protocol.TokenizeRequest))
async def tokenize(request: Request):
    """vLLM's /tokenize: ``{"tokens", "count", "max_model_len", "token_strs"}``."""
    state = request.app.state
    tokenizer, context = state.tokenizer, state.max_model_len
    body = await read_body(request, protocol.TokenizeRequest)
    check_model(body.model, state.model_name)
    if body.prompt is not None:
        refuse_unfittable(len(body.prompt), context, tokenizer, "prompt")
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, special)
    else:
        ids = await _chat_ids(body, tokenizer, context)
    return {"count": len(ids), "max_model_len": context, "tokens": ids,
            "token_strs": tokenizer.token_strings(ids) if body.return_token_strs else None}


async def _chat_ids(body, tokenizer, context: int) -> list[int]:
    """The ids of ``body.messages`` rendered by the chat template (the assistant's turn opened only if
    ``add_generation_prompt``), encoded with special tokens only if ``add_special_tokens``."""
    chat = [m.as_template_message() for m in body.messages]
    check_tool_calls_render(chat, tokenizer)
    refuse_unfittable_chat(chat, context, tokenizer)
    try:  # in a thread, as the chat route does: a long chat renders for a while
        text = await asyncio.to_thread(tokenizer.apply_chat_template, chat,
                                       add_generation_prompt=body.add_generation_prompt,
                                       **(body.chat_template_kwargs or {}))
    except ValueError as error:
        raise APIError(400, str(error), "messages") from None
    return await asyncio.to_thread(tokenizer.encode, text, bool(body.add_special_tokens))


@router.post("/detokenize", openapi_extra=protocol.openapi_request_body(protocol.DetokenizeRequest))
async def detokenize(request: Request):
    """vLLM's /detokenize: ``{"prompt": text}``, special tokens written out."""
    body = await read_body(request, protocol.DetokenizeRequest)
    check_model(body.model, request.app.state.model_name)
    return {"prompt": decode_ids(request.app.state.tokenizer, body.tokens, "tokens")}


@router.get("/tokenizer_info")
async def get_tokenizer_info(request: Request):
    """vLLM's /tokenizer_info (its --enable-tokenizer-info-endpoint): what lm-eval's remote
    tokenizer reads (the special tokens, the chat template)."""
    tokenizer = request.app.state.tokenizer
    special = {name: tokenizer.special_tokens.get(name) for name in _SPECIAL_TOKENS}
    if special["eos_token"] is None and tokenizer.eos_token_id is not None:
        special["eos_token"] = tokenizer.id_to_token(tokenizer.eos_token_id)
    return {"tokenizer_class": "PreTrainedTokenizerFast", **special,
            "chat_template": tokenizer.chat_template, "model_max_length": request.app.state.max_model_len}


_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
