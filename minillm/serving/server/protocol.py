"""The OpenAI API's request bodies (pydantic models) and response bodies (the Reply classes' JSON).

Field names, defaults and ranges are OpenAI's (platform.openai.com/docs/api-reference), plus
vLLM's extensions to them (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, a prompt
given as token ids, ``cache_salt``) and Anthropic's ``cache_control`` (a cache point, with usage's
``cache_creation_input_tokens`` and ``cache_read_input_tokens``). Parsing is strict, as OpenAI's API is: ``"5"`` is not a number, an unknown
field is an error (it is more often a typo than a feature), so a bad request fails here with the
field's name instead of deep inside the engine.

Fields that change nothing here are accepted as vLLM accepts them (:data:`IGNORED_FIELDS`; the app
logs one line naming them); an OpenAI field that would change the answer and is not implemented
(tools, ``functions``, ``prediction``, ...: :data:`UNSUPPORTED_FIELDS`) is a 400 that says
"not supported by minillm", not a silently different answer.

    JSON body --validate--> CompletionRequest / ChatCompletionRequest --(app.py)--> SamplingParams
    RequestOutput (engine) --CompletionReply / ChatReply--> the whole answer, or one chunk per token

Errors have OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` (:func:`error_body`).
"""

from __future__ import annotations

import copy
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# OpenAI's documented default when a request gives no temperature (vLLM's too).
OPENAI_DEFAULT_TEMPERATURE = 1.0
# Accepted and ignored: they change no token of the answer (OpenAI's bookkeeping, or tools turned off).
IGNORED_FIELDS = ("store", "metadata", "user", "parallel_tool_calls", "tools", "tool_choice", "guided_decoding_backend")
# OpenAI's (and vLLM's) fields that would change the answer, which minillm does not implement.
UNSUPPORTED_FIELDS = {"tools", "tool_choice", "functions", "function_call", "prediction", "audio",
                      "modalities", "reasoning_effort", "web_search_options", "suffix", "best_of"}
# /v1/completions' default max_tokens (OpenAI's legacy API and vLLM: 16). Chat has none: the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The most choices one request may ask for (OpenAI's limit for n; best_of is refused).
MAX_N = 128
# The most top tokens /v1/completions' logprobs may ask for (vLLM's default max_logprobs; OpenAI's legacy API: 5).
MAX_COMPLETION_LOGPROBS = 20
# vLLM's floor for -inf (a token the model rules out): JSON has no infinity
LOGPROB_FLOOR = -9999.0
# A token id has at most 10 digits: tokenizers' ids are 32-bit, no vocabulary comes near 10**10
MAX_TOKEN_ID_DIGITS = 10
# Stop strings are words and markers; each token's check reads the last len(stop) characters of the text
MAX_STOP_CHARS = 1024


class _Strict(BaseModel):
    # allow_inf_nan: JSON has no infinity, but 1e400 parses as one (a repetition_penalty of inf
    # passed every bound here and failed later without naming its field)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False  # one last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # vLLM's extension: with include_usage, the usage so far on every chunk

    @property
    def usage_mode(self) -> str | None:
        """None: no usage; "final": a last usage chunk; "every": that, and the usage on each chunk
        (vLLM's rule: continuous_usage_stats counts only with include_usage)."""
        if not self.include_usage:
            return None
        return "every" if self.continuous_usage_stats else "final"


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" with ``json_schema: {"name", "schema", "strict", "description"}``; also
    "json_object" with a top-level ``schema`` (Together's and Anyscale's form, which instructor
    <= 1.3's JSON_SCHEMA mode sends): JSON valid against that schema."""

    model_config = ConfigDict(serialize_by_alias=True)  # dumped as "schema", the name clients send
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None
    schema_: dict | None = Field(None, alias="schema")  # "schema" itself would shadow BaseModel.schema

    @field_validator("json_schema")
    @classmethod
    def _has_schema(cls, spec, info):
        if spec is not None and not isinstance(spec.get("schema", {}), dict):
            raise ValueError("json_schema.schema must be a JSON schema (an object)")
        unknown = sorted(set(spec or {}) - {"name", "schema", "strict", "description"})
        if unknown:
            raise ValueError(f"json_schema takes name, schema, strict and description, not {', '.join(unknown)}")
        return spec


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (its StructuredOutputsParams, vLLM >= 0.11): one of json (a
    schema), regex, choice, grammar (Lark or GBNF) or json_object. Of the tuning flags of vLLM's
    own backends, disable_any_whitespace and whitespace_pattern are honoured (JSON only); the
    others are accepted and change nothing here."""

    json_: dict | str | None = Field(None, alias="json")  # "json" itself would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None  # vLLM's: refused as not supported by minillm
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class CacheControl(_Strict):
    """Anthropic's ``cache_control`` (its prompt caching; Bedrock's cache point is the same idea): the
    prefix up to the end of the block that carries it is kept in the KV tiers, its blocks pinned for
    ``ttl`` ("5m" by default, or "1h"); usage then counts it in ``cache_creation_input_tokens``."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class _SamplingFields(_Strict):
    """The fields both endpoints share: the model, sampling and stopping, and the cache's salt."""

    model: str | None = None
    # vLLM's: requests with different salts never share a KV block, in any tier (the salt enters the first
    # block's hash), so one tenant cannot time another's cached prefix (arXiv 2411.18191, CVE-2025-46570)
    cache_salt: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's extension
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # parallel sampling: n choices (the engine's max_num_seqs limits it too)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    user: str | None = None  # OpenAI's end-user id: accepted, ignored
    # {token id (a string, as JSON keys are): bias in [-100, 100]} added to the logits (OpenAI's)
    logit_bias: dict[str, float] | None = None
    # structured output (constrained decoding, minillm/structured/): OpenAI's, vLLM's, vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # vLLM's older spelling of structured_outputs.whitespace_pattern
    guided_decoding_backend: str | None = None  # vLLM's older backend choice: accepted, ignored (one backend here)

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias):
        for key, value in (bias or {}).items():
            # ASCII digits only: "²".isdigit() is True and int("²") fails; a 5,000-digit key would
            # take int() seconds (Python refuses over 4,300) and name no token of any vocabulary
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys are token ids (e.g. \"50256\"), got {key!r:.40}")
            if len(key.lstrip("0")) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"logit_bias keys are token ids; {key[:12]}... ({len(key):,} digits) is beyond "
                                 "any vocabulary")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key:.12}")
        # "007" is token 7; the zeros go, or int() refuses a key of over 4,300 digits that names token 1
        return None if bias is None else {key.lstrip("0") or "0": value for key, value in bias.items()}

    def structured_fields(self) -> dict:
        """The structured-output fields the request set, for minillm.structured.grammar_from_request."""
        fields = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}
        if self.response_format is not None:
            fields["response_format"] = self.response_format.model_dump(exclude_none=True)
        if self.structured_outputs is not None:
            fields["structured_outputs"] = self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        if self.guided_whitespace_pattern is not None:  # the older spelling joins the newer one's tuning fields
            fields["structured_outputs"] = {**fields.get("structured_outputs", {}),
                                            "whitespace_pattern": self.guided_whitespace_pattern}
        return fields

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, salt):
        if salt is not None and not salt:
            raise ValueError("must be a non-empty string (one per tenant), or left out")
        return salt

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options, info):
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options needs stream: true")
        return options

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop must be up to 4 non-empty strings (OpenAI's limit)")
        if max(map(len, stops), default=0) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS:,} characters, got "
                             f"{max(map(len, stops)):,}; the text held back while it might be one grows with it")
        return stop

    def ignored_fields(self) -> list[str]:
        """The request's fields that change nothing (:data:`IGNORED_FIELDS`), for the server's log."""
        return sorted(set(IGNORED_FIELDS) & self.model_fields_set)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: a prompt (text, or token ids as vLLM allows) to continue.

    ``echo``: the answer starts with the prompt; with ``logprobs: N`` the prompt's tokens come
    with their logprobs too (the first one's null), which is how evaluation harnesses (lm-eval's
    ``local-completions``) score a continuation. ``max_tokens: 0`` with ``echo``: the prompt
    and its logprobs only, no new token.
    """

    prompt: str | list[int]
    echo: bool = False
    cache_control: CacheControl | None = None  # the whole prompt is the cache point (Anthropic's, top level)
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        """A string or token ids; a batch of one (``["text"]``, ``[[ids]]``) is that one prompt."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("one prompt per request (a list of prompts is a batch): send each in its own request")
        if not isinstance(prompt, (str, list)):
            raise ValueError("prompt must be a string or a list of token ids")
        if not prompt:
            raise ValueError("the prompt is empty; give some text or at least one token id")
        bad = next((i for i, t in enumerate(prompt) if type(t) is not int), None) if isinstance(prompt, list) else None
        if bad is not None:
            raise ValueError(f"a prompt given as a list holds token ids (integers); item {bad} is {prompt[bad]!r:.40}")
        return prompt

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, max_tokens, info):
        if max_tokens == 0 and not info.data.get("echo"):
            raise ValueError("0 generates nothing: it needs echo: true (the prompt, and with logprobs its tokens' "
                             "logprobs); else ask for at least 1 token")  # (the error names the field before it)
        return max_tokens


class TextPart(_Strict):
    type: Literal["text"]  # images and audio: the models minillm runs read text only
    text: str
    cache_control: CacheControl | None = None  # marks the end of its message as a cache point


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A tool call an assistant made earlier in the conversation (OpenAI's message.tool_calls[i])."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # history only: minillm makes no tool calls itself
    cache_control: CacheControl | None = None  # the prefix up to the end of this message is a cache point

    def cache_marks(self) -> list[CacheControl]:
        """The ``cache_control`` marks on this message and on its parts, in order ([] without any)."""
        parts = self.content if isinstance(self.content, list) else []
        return [mark for mark in [self.cache_control] + [part.cache_control for part in parts] if mark is not None]

    def as_template_message(self) -> dict:
        """The dict a chat template reads: "developer" (OpenAI's newer name for "system") as
        "system", text parts joined by newlines into one string (vLLM's "string" content format:
        most templates, SmolLM2's among them, concatenate content as a string)."""
        message = self.model_dump(exclude_none=True, exclude={"cache_control"})  # for the server, not the model
        if self.role == "developer":
            message["role"] = "system"
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        if self.tool_calls:
            message.setdefault("content", "")  # a turn of tool calls only: templates read its content
        return message


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: a conversation, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's: extra chat template variables, e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, bool | int | float | str] | None = None
    # accepted, ignored (IGNORED_FIELDS): stored completions, their tags, tools that are off
    store: bool | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict] | None = None  # only [] (no tools)
    tool_choice: str | dict | None = None  # only "none"

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools):
        if tools:
            raise ValueError("function calling is not supported by minillm; send tools: [] or leave it out")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tools_off(cls, choice):
        if choice is not None and choice != "none":
            raise ValueError('function calling is not supported by minillm; only "none" is accepted')
        return choice

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_renderers_own_arguments(cls, kwargs):
        # These are apply_chat_template's parameters, set by the server: passed again they would
        # collide with them (a TypeError, once a 500).
        taken = sorted(set(kwargs or {}) & {"messages", "add_generation_prompt", "tools", "documents",
                                            "template", "special_tokens"})
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the server sets it from the "
                             "request; remove it")
        return kwargs


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a ``prompt``, or ``messages`` rendered with the chat template.

    ``add_special_tokens``: the tokenizer's BOS/EOS around a prompt (vLLM's default: true for a
    prompt, false for messages, whose template writes its own); ``return_token_strs``: each
    token's text too."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, validate_default=True)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, bool | int | float | str] | None = None

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(cls, messages, info):
        if (messages is None) == (info.data.get("prompt") is None):
            raise ValueError("give a prompt (text) or messages (a chat), one of them")
        return messages


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids -> ``{"prompt": text}`` (special tokens kept)."""

    model: str | None = None
    tokens: list[int]


# -- the request bodies in the OpenAPI document ----------------------------------------------

_COMPONENTS = "#/components/schemas/{model}"


def openapi_request_body(model_class: type[BaseModel]) -> dict:
    """A route's ``openapi_extra`` that describes its JSON body as ``model_class``.

    The routes read their bodies themselves (app.py's ``_parse``: strict JSON, OpenAI's error
    shape), so FastAPI does not know them; this puts each body's schema into /openapi.json and
    /docs (and gives a fuzzer, tests/serving/server/test_server_fuzz.py, the fields to generate). The
    nested models are references into ``components.schemas`` (:func:`openapi_components`).
    """
    schema = model_class.model_json_schema(ref_template=_COMPONENTS)
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def openapi_components(*model_classes: type[BaseModel]) -> dict:
    """The nested models (``$defs``) of ``model_classes``' schemas, by name: the document's
    ``components.schemas`` that :func:`openapi_request_body`'s references point into."""
    return {name: schema for model_class in model_classes
            for name, schema in model_class.model_json_schema(ref_template=_COMPONENTS).get("$defs", {}).items()}


# -- responses -------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, cache_write_tokens: int = 0) -> dict:
    """OpenAI's ``usage``, with Anthropic's two cache counts beside it.

    ``cached_tokens``: prompt tokens whose K/V came from the cache (the pool or a lower tier): OpenAI's
    ``prompt_tokens_details.cached_tokens`` and Anthropic's ``cache_read_input_tokens``.
    ``cache_write_tokens``: tokens of the request's cache point (``cache_control``) it wrote or pinned:
    Anthropic's ``cache_creation_input_tokens``. The providers bill the three kinds of prompt token at
    different prices (Anthropic: a read 0.1x the base input price, a 5-minute write 1.25x, a 1-hour write 2x).
    """
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "cache_creation_input_tokens": cache_write_tokens, "cache_read_input_tokens": cached_tokens}


def finish_reason(engine_reason: str | None) -> str | None:
    """The engine's reason as OpenAI names it: "stop" for a natural end (EOS, a stop id or
    string), "length" for max_tokens or the context; an abort ends a stream as "abort" (vLLM's)."""
    return {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}.get(engine_reason, engine_reason)


def now_s() -> int:
    """``created``: Unix seconds."""
    return int(time.time())


class CompletionReply:
    """Renders one /v1/completions request's engine outputs as OpenAI's JSON: the whole
    ``text_completion``, or its stream of chunks (each with the text added since the last one).

    Args (keyword, /v1/completions only):
        tokenizer: for the logprobs' token strings.
        echo_text: with ``echo``, the prompt's text: the answer starts with it (a stream's first
            chunk carries it, with the first token's text, as vLLM's), and with ``num_logprobs``
            the logprobs start with the prompt's tokens (``prompt_ids``).
        num_logprobs: ``logprobs: N``: OpenAI's legacy ``logprobs`` object (:meth:`_legacy_logprobs`).
        generates: False for ``max_tokens: 0``: the engine's one token is left out of the answer.
    """

    object, chunk_object = "text_completion", "text_completion"
    index = 0  # the choice it renders (n > 1: one reply per choice, :meth:`for_choice`)

    def __init__(self, request_id: str, model: str, *, tokenizer=None, echo_text: str | None = None,
                 prompt_ids: list[int] | None = None, num_logprobs: int | None = None, generates: bool = True):
        self.id, self.model, self.created = request_id, model, now_s()
        self.text_sent = 0  # characters of the answer already streamed
        self.tokenizer, self.echo_text, self.prompt_ids = tokenizer, echo_text, prompt_ids
        self.num_logprobs, self.generates = num_logprobs, generates
        self.echoed, self.tokens_sent, self.text_offset = False, 0, 0  # the stream's progress

    def _completion_tokens(self, out) -> int:
        return len(out.token_ids) if self.generates else 0

    def _text_and_tokens(self, out, start: int) -> tuple[str, list[int], list]:
        """The answer's text from character ``start`` of the output on, and its tokens and their
        logprob entries from output token ``self.tokens_sent`` on; the echoed prompt before them
        the first time (``self.echoed``)."""
        text = out.text[start:] if self.generates else ""
        ids = list(out.token_ids[self.tokens_sent:]) if self.generates else []
        entries = list(out.logprobs[self.tokens_sent:]) if self.generates and out.logprobs is not None else []
        if self.echo_text is not None and not self.echoed:
            text, ids = self.echo_text + text, self.prompt_ids + ids
            entries = list(out.prompt_logprobs or [None] * len(self.prompt_ids)) + entries
            self.echoed = True
        self.tokens_sent = len(out.token_ids)
        return text, ids, entries

    def _legacy_logprobs(self, ids: list[int], entries: list) -> dict | None:
        """OpenAI's legacy ``logprobs``: ``tokens`` (each token's text), ``token_logprobs`` (null
        for the prompt's first token: nothing precedes it), ``top_logprobs`` (a dict per token:
        the token itself, then the N most likely, as vLLM's: N or N + 1 entries) and
        ``text_offset`` (where each token starts in the answer's text)."""
        if self.num_logprobs is None:
            return None
        strings = self.tokenizer.token_strings(ids)
        tops = [{i for i, _ in entry[1][: self.num_logprobs]} for entry in entries if entry is not None]
        names = dict(zip(sorted(set().union(*tops)), self.tokenizer.token_strings(sorted(set().union(*tops)))))
        token_logprobs, top_logprobs, offsets = [], [], []
        for token_id, string, entry in zip(ids, strings, entries):
            offsets.append(self.text_offset)
            self.text_offset += len(string)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            logprob, top = entry
            token_logprobs.append(max(logprob, LOGPROB_FLOOR))
            top_logprobs.append({string: max(logprob, LOGPROB_FLOOR),
                                 **{names[i]: max(lp, LOGPROB_FLOOR) for i, lp in top[: self.num_logprobs]}})
        return {"tokens": strings, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _envelope(self, object_name: str, choices: list, **fields) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices, **fields}

    def response(self, out) -> dict:
        text, ids, entries = self._text_and_tokens(out, 0)
        choice = {"index": self.index, "text": text, "logprobs": self._legacy_logprobs(ids, entries),
                  "finish_reason": finish_reason(out.finish_reason)}
        return self._envelope(self.object, [choice], usage=_usage(out, self._completion_tokens(out)))

    def first_chunks(self, first, usage_mode: str | None) -> list[dict]:
        return []

    def chunk(self, out, usage_mode: str | None) -> dict:
        """The chunk for one output: the new text ("" while the engine holds a partial
        character or a possible stop string back), and the finish reason on the last one.
        ``usage_mode``: :attr:`StreamOptions.usage_mode`."""
        delta, ids, entries = self._text_and_tokens(out, self.text_sent)
        self.text_sent = len(out.text)
        choice = {"index": self.index, "text": delta, "logprobs": self._legacy_logprobs(ids, entries),
                  "finish_reason": finish_reason(out.finish_reason)}
        return self._envelope(self.chunk_object, [choice],
                              **_usage_field(out, usage_mode, self._completion_tokens(out)))

    def for_choice(self, index: int) -> "CompletionReply":
        """A copy of this reply, before it has rendered anything, for choice ``index`` of a request
        with n > 1: its choices carry that index, and it keeps its own stream state."""
        reply = copy.copy(self)
        reply.index = index
        return reply

    def usage_chunk(self, out) -> dict:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        return self._envelope(self.chunk_object, [], usage=_usage(out, self._completion_tokens(out)))


class ChatReply(CompletionReply):
    """The same for /v1/chat/completions: ``message`` / ``delta`` instead of ``text``, and the
    tokens' logprobs when asked (OpenAI's ``logprobs.content``)."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, tokenizer):
        super().__init__(request_id, model)
        self.tokenizer, self.logprobs_sent = tokenizer, 0

    def response(self, out) -> dict:
        choice = {"index": self.index, "message": {"role": "assistant", "content": out.text},
                  "logprobs": self._logprobs(out, 0), "finish_reason": finish_reason(out.finish_reason)}
        return self._envelope(self.object, [choice], usage=_usage(out))

    def first_chunks(self, first, usage_mode: str | None) -> list[dict]:
        """The role chunk; with continuous usage it counts the prompt and no output yet, as vLLM's."""
        choice = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        usage_field = _usage_field(first, usage_mode, completion_tokens=0)
        return [self._envelope(self.chunk_object, [choice], **usage_field)]

    def chunk(self, out, usage_mode: str | None) -> dict:
        delta, self.text_sent = out.text[self.text_sent:], len(out.text)
        logprobs, self.logprobs_sent = self._logprobs(out, self.logprobs_sent), len(out.token_ids)
        choice = {"index": self.index, "delta": {"content": delta} if delta or not out.finished else {},
                  "logprobs": logprobs, "finish_reason": finish_reason(out.finish_reason)}
        return self._envelope(self.chunk_object, [choice], **_usage_field(out, usage_mode))

    def _logprobs(self, out, start: int) -> dict | None:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}`` for the
        tokens from ``start`` on. A token holding part of a UTF-8 character shows it as ``\\xNN``
        escapes in ``token``; its ``bytes`` are the raw ones (joined, they decode to the text)."""
        if out.logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.tokenizer.token_strings([token_id])[0], "logprob": max(logprob, LOGPROB_FLOOR),
                    "bytes": list(self.tokenizer.token_bytes([token_id])[0])}

        content = [dict(entry(token_id, logprob), top_logprobs=[entry(i, lp) for i, lp in top])
                   for token_id, (logprob, top) in zip(out.token_ids[start:], out.logprobs[start:])]
        return {"content": content}


def response_n(replies: list[CompletionReply], outs: list) -> dict:
    """The whole answer of a request with n > 1: choice i rendered by ``replies[i]`` from its last
    output ``outs[i]``, and one ``usage`` (:func:`sum_usage`)."""
    bodies = [reply.response(out) for reply, out in zip(replies, outs)]
    return dict(bodies[0], choices=[body["choices"][0] for body in bodies],
                usage=sum_usage([body["usage"] for body in bodies]))


def sum_usage(usages: list[dict]) -> dict:
    """The usage of n choices of one prompt: the prompt counted once, the completions' tokens
    summed (OpenAI's and vLLM's rule)."""
    first = usages[0]
    return usage(first["prompt_tokens"], sum(u["completion_tokens"] for u in usages),
                 first["prompt_tokens_details"]["cached_tokens"], first["cache_creation_input_tokens"])


def _usage(out, completion_tokens: int | None = None) -> dict:
    generated = len(out.token_ids) if completion_tokens is None else completion_tokens
    return usage(len(out.prompt_token_ids), generated, out.num_cached_tokens, out.num_cache_write_tokens)


def _usage_field(out, usage_mode: str | None, completion_tokens: int | None = None) -> dict:
    """A chunk's ``usage``: absent, null until the last chunk, or the counts so far (continuous)."""
    if usage_mode is None:
        return {}
    return {"usage": _usage(out, completion_tokens) if usage_mode == "every" else None}


# -- errors ------------------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 500: "server_error", 503: "server_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``. The message is one
    line: a line break the request put in it (an unknown key, a value quoted back) is escaped."""
    message = message.replace("\r", "\\r").replace("\n", "\\n")
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """(one-line message, the field) for pydantic's first complaint, e.g.
    ``messages.0.role: Input should be 'system', 'developer', ... (got 'robot')``."""
    errors = error.errors()
    # a union (str | list[...]) fails once per branch: the deepest complaint is the one that helps
    first = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    # drop the union branch names pydantic puts in the path ("str", "list[TextPart]", "function-before[...]")
    loc = [part for part in first["loc"] if isinstance(part, int) or part.isidentifier() and part != "str"]
    if first["type"] == "extra_forbidden" and loc[-1:] != list(first["loc"][-1:]):
        loc.append(first["loc"][-1])  # an unknown field's name stays, whatever its characters
    param = ".".join(str(part) for part in loc) if loc else None
    if first["type"] == "json_invalid":
        return f"the body is not valid JSON: {first['msg']}", None
    message = first["msg"].removeprefix("Value error, ")
    got = first.get("input")
    if first["type"] == "extra_forbidden" and loc and loc[-1] in UNSUPPORTED_FIELDS:
        message = "not supported by minillm (it would change the answer); remove it"
    elif first["type"] == "extra_forbidden":
        message = "unknown field (not an OpenAI or vLLM request field minillm accepts); remove it"
    elif first["type"] != "missing" and not isinstance(got, (dict, list)):
        message += f" (got {got!r:.60})"
    return (f"{param}: {message}" if loc else message), param
