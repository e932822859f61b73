"""Chat templates rendered string for string like transformers' apply_chat_template.

Each case writes a model folder (a tiny byte-level tokenizer.json, a tokenizer_config.json
with one of the templates in tests/chat_templates/) and renders the same chat with minillm and
with a transformers PreTrainedTokenizerFast loaded from that folder: the oracle.
"""

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from minillm.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parents[1] / "chat_templates"
SPECIALS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current temperature at a place, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? <b>&</b>"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,  # OpenAI clients send null content with tool calls
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": {"temperature_c": 21}},
]  # fmt: skip
PARTS_CHAT = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    {"role": "user", "content": "And here?"},
]
REASONING_CHAT = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "Two and two make four."},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "thinking": "Three and three."},
]
QWEN3_THINKING_CHAT = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4"},  # reasoning inline: dropped
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "21 °C"},
]  # fmt: skip

# (template file, messages, keyword arguments of apply_chat_template, tokenizer_config changes)
CASES = {
    "smollm2-default-system": ("smollm2", SYSTEM_CHAT[1:2], {}, {}),
    "smollm2-own-system": ("smollm2", SYSTEM_CHAT, {"add_generation_prompt": False}, {}),
    "llama3-date-from-strftime_now": ("llama3", SYSTEM_CHAT, {}, {}),
    "llama3-date-string-kwarg": ("llama3", SYSTEM_CHAT[1:], {"date_string": "01 Jan 2030"}, {}),
    "llama3-tools-in-user-message": ("llama3", SYSTEM_CHAT[1:2], {"tools": [WEATHER_TOOL]}, {}),
    "llama3-tools-in-system": ("llama3", SYSTEM_CHAT, {"tools": [WEATHER_TOOL], "tools_in_user_message": False}, {}),
    "llama3-tool-calls": ("llama3", TOOL_CHAT, {}, {}),
    "llama3-null-bos-token": ("llama3", SYSTEM_CHAT[1:2], {}, {"bos_token": None}),
    "mistral-system-alternating": ("mistral", SYSTEM_CHAT, {}, {"bos_token": "<s>", "eos_token": "</s>"}),
    "mistral-added-token-dicts": ("mistral", SYSTEM_CHAT[1:], {}, {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "special": True}}),
    "parts-namespace-generation": ("parts", PARTS_CHAT, {}, {}),
    "parts-extra-kwarg": ("parts", PARTS_CHAT[:1], {"enable_thinking": False}, {}),
    "reasoning-aliases": ("reasoning", REASONING_CHAT, {}, {}),
    # Qwen3-0.6B's template (as llama.cpp keeps it: models/templates/Qwen-Qwen3-0.6B.jinja)
    "qwen3-thinking-default": ("qwen3", SYSTEM_CHAT, {}, {}),
    "qwen3-enable-thinking-false": ("qwen3", SYSTEM_CHAT, {"enable_thinking": False}, {}),
    "qwen3-enable-thinking-true": ("qwen3", SYSTEM_CHAT[1:2], {"enable_thinking": True}, {}),
    "qwen3-reasoning-and-tools": ("qwen3", QWEN3_THINKING_CHAT, {"tools": [WEATHER_TOOL]}, {}),
    "qwen3-history-no-prompt": ("qwen3", QWEN3_THINKING_CHAT[:2], {"add_generation_prompt": False}, {}),
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    """A byte-level BPE with no merges and the special tokens: rendering never reads the vocabulary."""
    tok = Tokenizer(models.BPE(vocab={chr(c): i for i, c in enumerate(range(33, 127))}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>"])
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


def _model_folder(root: Path, tokenizer_json: Path, template: str | list | None, config: dict) -> Path:
    """An HF-style folder: tokenizer.json, tokenizer_config.json, and config.json (what minillm needs)."""
    root.mkdir()
    shutil.copy(tokenizer_json, root / "tokenizer.json")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIALS, **config}
    if template is not None:
        tokenizer_config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (root / "config.json").write_text("{}")
    return root


def _both(folder: Path):
    return load_tokenizer(folder), transformers.PreTrainedTokenizerFast.from_pretrained(folder)


def _render_both(folder: Path, messages, kwargs: dict) -> tuple[str, str]:
    ours, theirs = _both(folder)
    kwargs = {"add_generation_prompt": True, **kwargs}
    return ours.apply_chat_template(messages, **kwargs), theirs.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("case", CASES)
def test_renders_like_transformers(tokenizer_json, tmp_path, case):
    name, messages, kwargs, config = CASES[case]
    template = (TEMPLATES / f"{name}.jinja").read_text()
    folder = _model_folder(tmp_path / "model", tokenizer_json, template, config)
    ours, theirs = _render_both(folder, messages, kwargs)
    assert ours == theirs
    assert "None" not in ours


@pytest.mark.parametrize(("enable_thinking", "ending"), [
    (None, "<|im_start|>assistant\n"), (True, "<|im_start|>assistant\n"),
    (False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),  # an empty thought: the model answers at once
])  # fmt: skip
def test_qwen3_enable_thinking_opens_the_answer(tokenizer_json, tmp_path, enable_thinking, ending):
    template = (TEMPLATES / "qwen3.jinja").read_text()
    tok = load_tokenizer(_model_folder(tmp_path / "model", tokenizer_json, template, {}))
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    prompt = tok.apply_chat_template(SYSTEM_CHAT[1:2], **kwargs)
    assert prompt == "<|im_start|>user\nWhat is 2+2? <b>&</b><|im_end|>\n" + ending


@pytest.mark.parametrize("template_name", ["qwen3", "llama3"])
def test_thinking_flag_warns_where_the_template_ignores_it(tokenizer_json, tmp_path, template_name, capsys):
    """The CLI's --no-enable-thinking warns exactly when it would not change the prompt (the oracle:
    the template rendered with and without enable_thinking=False)."""
    from types import SimpleNamespace

    from minillm.cli.common import warn_if_template_ignores_thinking

    template = (TEMPLATES / f"{template_name}.jinja").read_text()
    tok = load_tokenizer(_model_folder(tmp_path / "model", tokenizer_json, template, {}))
    unchanged = tok.apply_chat_template(SYSTEM_CHAT[1:2]) == tok.apply_chat_template(SYSTEM_CHAT[1:2],
                                                                                       enable_thinking=False)
    warn_if_template_ignores_thinking(SimpleNamespace(enable_thinking=False), tok)
    assert ("has no effect" in capsys.readouterr().err) == unchanged


def test_strftime_now_writes_todays_date(tokenizer_json, tmp_path):
    template = (TEMPLATES / "llama3.jinja").read_text()
    tok = load_tokenizer(_model_folder(tmp_path / "model", tokenizer_json, template, {}))
    before = datetime.now().strftime("%d %b %Y")
    prompt = tok.apply_chat_template(SYSTEM_CHAT[1:2])
    assert f"Today Date: {before}\n" in prompt or before != datetime.now().strftime("%d %b %Y")  # midnight


def test_null_bos_token_renders_nothing(tokenizer_json, tmp_path):
    template = (TEMPLATES / "llama3.jinja").read_text()
    folder = _model_folder(tmp_path / "model", tokenizer_json, template, {"bos_token": None})
    assert load_tokenizer(folder).apply_chat_template(SYSTEM_CHAT[1:2]).startswith("<|start_header_id|>system")


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "roles must alternate"),
        ([{"role": "tool", "content": "a"}], "roles must alternate"),
        ([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}, {"role": "tool", "content": "c"}],
         "Only user and assistant roles are supported"),
    ],
)  # fmt: skip
def test_template_exception_is_a_one_line_value_error(tokenizer_json, tmp_path, messages, says):
    template = (TEMPLATES / "mistral.jinja").read_text()
    ours, theirs = _both(_model_folder(tmp_path / "model", tokenizer_json, template, {}))
    with pytest.raises(Exception) as oracle:
        theirs.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ValueError) as info:
        ours.apply_chat_template(messages)
    assert str(info.value) == f"chat template error: {oracle.value}"
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("template", "says"),
    [("{% for m in messages %}", "Unexpected end of template"), ("{{ messages[0].content + 1 }}", "str")],
)
def test_broken_template_is_a_one_line_value_error(tokenizer_json, tmp_path, template, says):
    tok = load_tokenizer(_model_folder(tmp_path / "model", tokenizer_json, template, {}))
    with pytest.raises(ValueError, match="^chat template error: .*" + says) as info:
        tok.apply_chat_template(SYSTEM_CHAT[1:2])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["default", "tool_use"])
def test_named_templates_pick_like_transformers(tokenizer_json, tmp_path, tools):
    named = [{"name": "default", "template": "plain: {{ messages[0].content }}"},
             {"name": "tool_use", "template": "tools: {{ tools | map(attribute='function.name') | join(',') }}"}]  # fmt: skip
    folder = _model_folder(tmp_path / "model", tokenizer_json, named, {})
    ours, theirs = _render_both(folder, SYSTEM_CHAT[1:2], {"tools": tools})
    assert ours == theirs == ("plain: What is 2+2? <b>&</b>" if tools is None else "tools: get_weather")


def test_chat_template_jinja_file_wins_like_transformers(tokenizer_json, tmp_path):
    """transformers now saves the template as chat_template.jinja beside tokenizer_config.json."""
    folder = _model_folder(tmp_path / "model", tokenizer_json, "old: {{ messages | length }}", {})
    (folder / "chat_template.jinja").write_text((TEMPLATES / "smollm2.jinja").read_text())
    ours, theirs = _render_both(folder, SYSTEM_CHAT, {})
    assert ours == theirs and ours.startswith("<|im_start|>system\nYou are terse.<|im_end|>")


@pytest.mark.parametrize(
    ("messages", "tools", "says"),
    [
        ([{"role": "user", "content": 3}], None, "'content' must be a string or a list of parts"),
        ([{"role": "user", "content": ["hi"]}], None, "'content' must be a string or a list of parts"),
        ([{"role": "assistant", "content": None}], None, "needs a 'content'"),
        ([{"content": "hi"}], None, "needs a string 'role'"),
        (SYSTEM_CHAT[1:2], [len], "tools must be JSON-schema dicts"),
        (SYSTEM_CHAT[1:2], None, "documents must be dicts"),
    ],
)
def test_bad_inputs_are_one_line_value_errors(tokenizer_json, tmp_path, messages, tools, says):
    template = (TEMPLATES / "llama3.jinja").read_text()
    tok = load_tokenizer(_model_folder(tmp_path / "model", tokenizer_json, template, {}))
    documents = ["a plain string"] if says.startswith("documents") else None
    with pytest.raises(ValueError, match=says) as info:
        tok.apply_chat_template(messages, tools=tools, documents=documents)
    assert "\n" not in str(info.value)


def test_sandbox_refuses_underscore_namespace_attributes(tokenizer_json, tmp_path):
    template = "{% set ns = namespace(_secret=1) %}{{ ns._secret }}"
    tok = load_tokenizer(_model_folder(tmp_path / "model", tokenizer_json, template, {}))
    with pytest.raises(ValueError, match="underscore"):
        tok.apply_chat_template(SYSTEM_CHAT[1:2])
