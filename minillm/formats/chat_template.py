"""Chat templates: a list of messages -> the prompt text a chat model was tuned on.

A chat template is a Jinja program shipped with the model (tokenizer_config.json's
``chat_template``, or a chat_template.jinja file). We render it the way transformers'
``apply_chat_template(tokenize=False)`` does, so the prompt is the same string
(source: transformers/utils/chat_template_utils.py, ``_compile_jinja_template`` and
``render_jinja_template``; tokenization_utils_base.py, ``apply_chat_template``):

    environment   sandboxed, trim_blocks + lstrip_blocks, loop controls,
                  {% generation %} blocks (rendered as plain text here)
    globals       raise_exception(msg), strftime_now(fmt), dict(...), namespace(...)
    filters       tojson (json.dumps, no HTML escaping, ensure_ascii=False)
    variables     messages, tools, documents, add_generation_prompt,
                  bos_token, eos_token, ... (only those the model defines, as strings),
                  and any extra keyword the caller passes (they win over special tokens)
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the special tokens a template can read by name.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def select_template(chat_template: str | dict | list, tools: list | None) -> str:
    """The one template to render. A model may ship several named ones (a dict, or the older
    list of ``{"name", "template"}``); like transformers, "tool_use" is taken when tools are
    passed and exists, else "default".

    Raises ValueError when named templates have neither.
    """
    if isinstance(chat_template, list):
        chat_template = {t["name"]: t["template"] for t in chat_template}
    if isinstance(chat_template, str):
        return chat_template
    if tools is not None and "tool_use" in chat_template:
        return chat_template["tool_use"]
    if "default" in chat_template:
        return chat_template["default"]
    raise ValueError(f"this model has chat templates {sorted(chat_template)} but no 'default' one")


def normalize_messages(messages) -> list[dict]:
    """Check the chat and drop keys whose value is None (as transformers does: templates test
    ``'content' in message``, and OpenAI-style clients send ``content=None`` with tool calls).

    A message is a dict with a string "role" and a "content" that is a string, a list of
    parts (OpenAI's ``[{"type": "text", "text": ...}]``) or a dict (a tool's JSON result);
    only an assistant message carrying "tool_calls" may omit it.

    A message's reasoning, under any of the names in use (``reasoning_content``, ``thinking``,
    ``reasoning``), is also put under the first two, as transformers does: Qwen3-style templates
    read ``reasoning_content``, gpt-oss's reads ``thinking``.

    Raises ValueError naming the first bad message.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
        message = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} needs a string 'role', got {message!r:.80}")
        if content is None and "tool_calls" not in message:
            raise ValueError(f"message {i} needs a 'content' (or 'tool_calls'), got {message!r:.80}")
        parts_ok = isinstance(content, list) and all(isinstance(part, dict) for part in content)
        if content is not None and not (isinstance(content, (str, dict)) or parts_ok):
            raise ValueError(
                f"message {i} 'content' must be a string or a list of parts like "
                f"[{{'type': 'text', 'text': ...}}], got {content!r:.80}"
            )
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


# Names a message's reasoning is passed under; templates read the first two (transformers' order).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str | None],
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **kwargs,
) -> str:
    """Render ``template`` with transformers' environment and variables (see the module docstring).

    Args:
        messages: already checked by :func:`normalize_messages`.
        special_tokens: name -> token string; None values are left undefined, as in
            transformers (a template's ``{{ bos_token }}`` then renders "", never "None").
        tools: JSON schemas of the functions the model may call (OpenAI / transformers format).
        documents: ``[{"title": ..., "text": ...}]`` for retrieval-augmented templates.
        **kwargs: extra template variables (``enable_thinking=False``, ``date_string=...``).

    Raises ValueError with one line: a tool or document that is not a dict, a template that
    does not parse, or one that fails or calls ``raise_exception(message)`` (the message is kept).
    """
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("tools must be JSON-schema dicts; transformers.utils.get_json_schema(fn) makes one")
    if documents is not None and not all(isinstance(document, dict) for document in documents):
        raise ValueError("documents must be dicts like {'title': ..., 'text': ...}")
    variables = {name: token for name, token in special_tokens.items() if token is not None}
    variables.update(kwargs)
    try:
        return _compile(template).render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except Exception as error:  # the template is the model's code: any failure in it is a bad-template error
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"chat template error: {first_line}") from error


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens
    with it (for training masks); for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    """Sandboxed because templates come with downloaded models; trim/lstrip_blocks because
    templates are written expecting them (no stray newlines around tags)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict())
    env.globals["namespace"] = _TemplateNamespace
    return env


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML; prompts need the plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    """Today's local date/time: Llama-3.x templates write "Today Date: 26 Jul 2024" with it."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without exposing the dict type to the sandbox."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()`` that refuses underscore names (a sandbox escape route)."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so namespace(self=...) still works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")
