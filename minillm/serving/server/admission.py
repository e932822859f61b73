"""What a request must pass before the engine sees it: each check fails it alone, with OpenAI's error.

    the API key ─> the body (size, UTF-8, JSON, fields) ─> the model's name ─> the prompt fits
    the context (decided from its length first, then from a prefix of its tokens) ─> the sampling
    knobs and the structured-output grammar ─> the cache point (cache_control) ─> AsyncEngine.generate

Every refusal is an :class:`APIError` (an HTTP status and OpenAI's ``message``, ``param``,
``code``), which the app's exception handler writes as OpenAI's error JSON. The routes
(``routes/``) call these; nothing here knows which route it serves, only which request field
(``param``) a refusal is about. Validating at admission is vLLM's rule too: what can be checked
before the engine is checked here, and what fails later fails one request at its step.
"""

from __future__ import annotations

import logging
import secrets

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from ...chat import common_prefix_len
from ...malloc_policy import give_back_freed_memory
from ...sampling import SamplingParams
from ...tokenizer import NORMALIZER_SLACK
from ..kv_tiers import CachePoint
from . import protocol

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20  # 8,192 token ids as JSON take about 50 KB

# After tokenising more than this (a MiB of characters: a few hundred thousand tokens, far past
# any context), glibc is told to give the tokenizer's memory back.
TRIM_AFTER_CHARS = 2**20

_POOL_NOTE = "; the model's context or the KV cache pool's positions, whichever is less: GET /v1/models"


class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready; its request was aborted."""


def check_api_key(request: Request) -> None:
    """A dependency of the /v1 and tokenizer routers (not a middleware: Starlette's would hide
    disconnects): APIError 401 unless the request sends ``Authorization: Bearer <app.state.api_key>``;
    no key set (None): every request passes."""
    api_key = request.app.state.api_key
    if api_key is not None and not secrets.compare_digest(
            request.headers.get("authorization", "").encode(), f"Bearer {api_key}".encode()):
        raise APIError(401, "a missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                            "(the server's --api-key)", code="invalid_api_key")


async def read_body(request: Request, model_class):
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


def log_ignored(request: Request, body) -> None:
    """One log line naming the request's fields that change nothing (vLLM warns the same way)."""
    if ignored := body.ignored_fields():
        logger.warning("%s %s: ignored fields (accepted as OpenAI's clients send them; they change nothing "
                       "here): %s", request.method, request.url.path, ", ".join(ignored))


def check_model(name: str | None, served: str) -> None:
    """APIError 404 when a request names a model other than the one ``served`` (None: any)."""
    if name is not None and name != served:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r} (GET /v1/models)",
                       "model", "model_not_found")


# -- the prompt fits the context ---------------------------------------------------------------


def refuse_unfittable(n_chars: int, context: int, tokenizer, param: str) -> None:
    """APIError 400 for a text that cannot fit the context whatever its tokens, decided from its
    length alone: tokenising megabytes only to refuse them would hold up every other request."""
    limit = context * tokenizer.max_token_chars * NORMALIZER_SLACK
    if n_chars > limit:
        raise APIError(400, f"the prompt is {n_chars:,} characters, more than this server's maximum context "
                            f"length of {context} tokens can hold (a token spells at most "
                            f"{tokenizer.max_token_chars} characters); shorten the prompt", param,
                       "context_length_exceeded")


def refuse_unfittable_chat(chat: list[dict], context: int, tokenizer) -> None:
    """:func:`refuse_unfittable` for a chat: its contents' characters, and its number of messages, which
    may not exceed the context's tokens (a chat template writes at least a role marker per message, so
    a million empty messages cannot fit, and rendering them alone would hold up the server for seconds)."""
    if len(chat) > context:
        raise APIError(400, f"the chat has {len(chat):,} messages, more than this server's maximum context length "
                            f"of {context} tokens can hold (each message takes at least one token); send fewer",
                       "messages", "context_length_exceeded")
    refuse_unfittable(sum(len(m.get("content") or "") for m in chat), context, tokenizer, "messages")


def check_tool_calls_render(chat: list[dict], tokenizer) -> None:
    """APIError 400 when an assistant message carries tool_calls that the model's chat template
    never reads (it would drop them, and the model would answer a different conversation)."""
    with_calls = [i for i, message in enumerate(chat) if message.get("tool_calls")]
    if with_calls and "tool_calls" not in str(tokenizer.chat_template):
        raise APIError(400, f"messages[{with_calls[0]}] carries tool_calls, but this model's chat template does not "
                            "render tool calls; send the calls' results as text content instead",
                       f"messages.{with_calls[0]}.tool_calls")


def check_prompt_ids(ids: list[int], vocab: int) -> list[int]:
    """``ids``, or APIError 400 naming the prompt for an id outside [0, vocab): checked here, since
    the engine's own check first makes a tensor, which an id past 64 bits fails in words about tensors."""
    bad = next((i for i, token_id in enumerate(ids) if not 0 <= token_id < vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt ids must be in [0, {vocab}) (the vocabulary); item {bad} is {ids[bad]}",
                       "prompt")
    return list(ids)


def encode_prompt(tokenizer, text: str, context: int, param: str, add_special_tokens: bool = True) -> list[int]:
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


def chat_prompt_ids(tokenizer, chat: list[dict], template_kwargs: dict | None, context: int) -> list[int]:
    """The chat template applied (with the assistant's turn opened, and the request's
    ``chat_template_kwargs``), then encoded (the template wrote the special tokens); APIError 400 when
    the template refuses the chat, or when the prompt cannot fit the ``context`` (:func:`encode_prompt`)."""
    try:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, **(template_kwargs or {}))
    except ValueError as error:
        raise APIError(400, str(error), "messages") from None
    return encode_prompt(tokenizer, text, context, "messages", add_special_tokens=False)


# -- the cache point (Anthropic's cache_control) ------------------------------------------------


MAX_CACHE_POINTS = 4  # Anthropic's limit on cache_control breakpoints in one request


def cache_point(mark, num_tokens: int) -> list[CachePoint]:
    """The engine's cache points for a ``cache_control`` ``mark`` over the first ``num_tokens`` prompt tokens:
    one, or none without a mark (or a prefix of no token)."""
    if mark is None or num_tokens < 1:
        return []
    return [CachePoint(num_tokens, CachePoint.parse_ttl(mark.ttl))]


def chat_cache_points(tokenizer, messages: list, chat: list[dict], prompt_ids: list[int],
                      template_kwargs: dict | None) -> list[CachePoint]:
    """The cache points of a chat: for each message marked with ``cache_control`` (on the message or one of
    its content parts), the prefix up to the end of that message, pinned for that mark's ttl (Anthropic's
    breakpoints, each with its own lifetime; a message with several marks, on its parts, pins its whole
    prefix for the longest of them). APIError 400 for more than 4 marks in the request (Anthropic's limit).

    Each prefix's length in tokens is where the chat template's rendering of ``chat[:i + 1]`` (no assistant
    turn opened) stops agreeing with ``prompt_ids``, the whole chat's::

        prompt_ids        [ system (marked 1h) | user 1 | assistant 1 | user 2 (marked 5m) | user 3 | assistant header ]
        chat[:1]          [ system (marked 1h) ]
                          |<- point 1: 1 h -->|
        chat[:i + 1]      [ system (marked 1h) | user 1 | assistant 1 | user 2 (marked 5m) ]
                          |<------------------------ point 2: 5 min ----------------------->|

    ``messages``: the request's :class:`~.protocol.ChatMessage` s (where the marks are); ``chat``: the same as
    the template reads them. APIError 400 when the template refuses to render a shorter chat."""
    marks = [(i, mark) for i, message in enumerate(messages) for mark in message.cache_marks()]
    if len(marks) > MAX_CACHE_POINTS:
        i = marks[MAX_CACHE_POINTS][0]
        raise APIError(400, f"a request takes at most {MAX_CACHE_POINTS} cache_control marks (cache points, as "
                            f"Anthropic's API), this one has {len(marks)}; keep the {MAX_CACHE_POINTS} that end the "
                            "prefixes you will send again", f"messages.{i}.cache_control")
    ttl_s: dict[int, float] = {}
    for i, mark in marks:  # one point per message: its longest ttl
        ttl_s[i] = max(ttl_s.get(i, 0.0), CachePoint.parse_ttl(mark.ttl))
    points = []
    for i, ttl in ttl_s.items():
        try:
            text = tokenizer.apply_chat_template(chat[: i + 1], add_generation_prompt=False,
                                                 **(template_kwargs or {}))
        except ValueError as error:
            raise APIError(400, f"the chat up to the message with cache_control cannot be rendered alone: {error}",
                           f"messages.{i}.cache_control") from None
        prefix = common_prefix_len(tokenizer.encode(text, add_special_tokens=False), prompt_ids)
        if prefix >= 1:
            points.append(CachePoint(prefix, ttl))
    return points


def fit_max_tokens(requested: int | None, prompt_len: int, context: int, prompt_param: str = "prompt") -> int:
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
        raise APIError(400, f"this server's maximum context length is {context} tokens (prompt and output together"
                            f"{_POOL_NOTE}), but {prompt_len + requested} were requested ({prompt_len} in the prompt, {requested} for "
                            "the completion); lower max_tokens or shorten the prompt", "max_tokens",
                       "context_length_exceeded")
    return requested


def decode_ids(tokenizer, ids: list[int], param: str) -> str:
    """The text of ``ids``, special tokens kept (vLLM's /detokenize and echo); APIError 400 for an id
    outside the vocabulary."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except ValueError as error:
        raise APIError(400, str(error), param) from None


# -- the sampling knobs and the grammar --------------------------------------------------------


def compile_grammar(body, tokenizer, engine):
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


def sampling_params(body, max_tokens: int, defaults: dict, grammar=None) -> SamplingParams:
    """The request's knobs; a knob it leaves out takes the checkpoint's default
    (generation_config.json, as vLLM's ``--generation-config auto``), else OpenAI's. ``grammar``:
    the structured-output constraint (:func:`compile_grammar`); ``logit_bias``'s token id strings become ints."""
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
        raise APIError(400, str(error), name if name in type(body).model_fields else param_of(str(error))) from None


# the engine's own checks (Engine.add_request) as the request field they are about: the 400's "param"
_ENGINE_PARAMS = (("n (sequences per request)", "n"), ("prompt ids must be in", "prompt"),
                  ("logit_bias", "logit_bias"))


def param_of(message: str) -> str | None:
    """The request field an engine's ValueError is about (its message's start), or None."""
    return next((param for start, param in _ENGINE_PARAMS if message.startswith(start)), None)
