"""Prompt caching at the HTTP surface (issue 44) on tiny_chat: vLLM's ``cache_salt`` keeps tenants apart,
Anthropic's ``cache_control`` marks a cache point whose tokens usage reports as written, then read, and a
server restarted on the same ``kv_offload_dir`` answers a repeated prompt from disk, with the text of a cold
run. The oracles: ``minillm.generate`` alone on the same model, and the chat template rendered by hand."""

import json

import httpx
import pytest
from live_server import app_of, live_server

import minillm
from minillm.block_hash import block_hashes, model_seed
from minillm.chat import common_prefix_len
from minillm.serving.engine import LLMEngine
from minillm.serving.kv_tiers import CachePoint
from minillm.serving.server.async_engine import AsyncEngine
from minillm.serving.server import protocol
from minillm.serving.server.admission import APIError, chat_cache_points

TIMEOUT_S = 60.0
BLOCK = 16
PROMPT_IDS = list(range(1000, 1040))  # 40 tokens: 2 full blocks can hit (the last token is always prefilled)
DOCUMENT = "A long document about the rivers of France. " * 12  # a system prompt of several blocks


def post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/{route}", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def completion(url: str, **fields) -> dict:
    return post(url, "completions", {"prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, **fields})


def chat_ids(tokenizer, messages, add_generation_prompt=True) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def alone(tiny_chat, prompt_ids, max_new_tokens=4) -> str:
    """The cold run's text: generate() alone, greedy, on the same model."""
    model, tokenizer = tiny_chat
    steps = minillm.generate(model, prompt_ids, minillm.SamplingParams(max_new_tokens=max_new_tokens),
                             tokenizer=tokenizer)
    return "".join(step.text for step in steps)


@pytest.fixture
def server(tiny_chat):
    """A fresh server per test: each test's first request meets an empty cache."""
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64) as url:
        yield url


# -- usage ---------------------------------------------------------------------------------------


def test_usage_reports_the_cache_three_ways():
    usage = protocol.usage(100, 7, cached_tokens=48, cache_write_tokens=64)
    assert usage == {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
                     "prompt_tokens_details": {"cached_tokens": 48},
                     "cache_creation_input_tokens": 64, "cache_read_input_tokens": 48}
    both = protocol.sum_usage([usage, protocol.usage(100, 3, 48, 64)])  # n = 2: the prompt once
    assert (both["completion_tokens"], both["cache_read_input_tokens"], both["cache_creation_input_tokens"]) == (
        10, 48, 64)


# -- cache_salt ----------------------------------------------------------------------------------


@pytest.mark.server
def test_cache_salt_shares_blocks_within_a_tenant_and_never_across(server, tiny_chat):
    cold = completion(server, cache_salt="tenant-a")
    other = completion(server, cache_salt="tenant-b")
    unsalted = completion(server)
    again = completion(server, cache_salt="tenant-a")
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (cold, other, unsalted, again)] == [
        0, 0, 0, BLOCK * ((len(PROMPT_IDS) - 1) // BLOCK)]
    assert again["usage"]["cache_read_input_tokens"] == 32
    texts = {r["choices"][0]["text"] for r in (cold, other, unsalted, again)}
    assert texts == {alone(tiny_chat, PROMPT_IDS)}  # the salt changes what is shared, never the answer


@pytest.mark.server
def test_cache_salt_on_chat_completions(server):
    body = {"messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Which river?"}],
            "max_tokens": 2, "temperature": 0}
    post(server, "chat/completions", dict(body, cache_salt="a"))
    assert post(server, "chat/completions", dict(body, cache_salt="b"))["usage"]["cache_read_input_tokens"] == 0
    assert post(server, "chat/completions", dict(body, cache_salt="a"))["usage"]["cache_read_input_tokens"] > 0


# -- cache_control -------------------------------------------------------------------------------


def test_a_chat_cache_point_ends_with_the_marked_message(tiny_chat):
    """The cache point's tokens are the template's rendering of the chat up to the marked message (no
    assistant turn opened): the whole prompt starts with exactly those tokens."""
    _, tokenizer = tiny_chat
    body = protocol.ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": DOCUMENT},
        {"role": "user", "content": [{"type": "text", "text": "First question?",
                                      "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "assistant", "content": "An answer."},
        {"role": "user", "content": "Second question?"}]})
    chat = [m.as_template_message() for m in body.messages]
    prompt_ids = chat_ids(tokenizer, chat)
    points = chat_cache_points(tokenizer, body.messages, chat, prompt_ids, None)
    marked = chat_ids(tokenizer, chat[:2], add_generation_prompt=False)
    assert points == [CachePoint(len(marked), 3600.0)] and prompt_ids[: len(marked)] == marked
    assert tokenizer.decode(marked[-5:], skip_special_tokens=False).endswith(" question?<|im_end|>\n")
    body.messages[1].content[0].cache_control = None
    assert chat_cache_points(tokenizer, body.messages, chat, prompt_ids, None) == []  # no mark: no point


def marked(content: str, ttl: str | None) -> dict:
    return {"type": "text", "text": content} | ({"cache_control": {"type": "ephemeral", "ttl": ttl}} if ttl else {})


TWO_MARKS = [{"role": "system", "content": [marked(DOCUMENT, "1h")]},
             {"role": "user", "content": [marked("First question?", None), marked("Some context for the question. " * 4, "5m")]},
             {"role": "assistant", "content": "An answer."},
             {"role": "user", "content": "Second question?"}]


def test_every_mark_is_a_cache_point_with_its_own_ttl(tiny_chat):
    """An earlier 1h mark before a later 5m one: two points, each prefix ending with its marked message (the
    template's rendering of the chat up to it), each with its own lifetime."""
    _, tokenizer = tiny_chat
    body = protocol.ChatCompletionRequest.model_validate({"messages": TWO_MARKS})
    chat = [m.as_template_message() for m in body.messages]
    prompt_ids = chat_ids(tokenizer, chat)
    lengths = [len(chat_ids(tokenizer, chat[:n], add_generation_prompt=False)) for n in (1, 2)]
    assert chat_cache_points(tokenizer, body.messages, chat, prompt_ids, None) == [
        CachePoint(lengths[0], 3600.0), CachePoint(lengths[1], 300.0)]
    both = [dict(m, cache_control={"type": "ephemeral", "ttl": "5m"}) for m in TWO_MARKS[:2]]  # 2 marks a message
    body = protocol.ChatCompletionRequest.model_validate({"messages": both + TWO_MARKS[2:]})
    assert chat_cache_points(tokenizer, body.messages, chat, prompt_ids, None) == [  # its longest ttl
        CachePoint(lengths[0], 3600.0), CachePoint(lengths[1], 300.0)]


def test_more_than_four_marks_are_refused_naming_cache_control(tiny_chat):
    _, tokenizer = tiny_chat
    five = [{"role": "user", "content": [marked(f"Part {i}.", "5m") for i in range(3)]},
            {"role": "assistant", "content": "Yes.", "cache_control": {"type": "ephemeral"}},
            {"role": "user", "content": [marked("More?", "1h")]}]
    body = protocol.ChatCompletionRequest.model_validate({"messages": five})
    chat = [m.as_template_message() for m in body.messages]
    with pytest.raises(APIError) as refused:
        chat_cache_points(tokenizer, body.messages, chat, chat_ids(tokenizer, chat), None)
    assert refused.value.status == 400 and refused.value.param == "messages.2.cache_control"
    assert "at most 4 cache_control marks" in str(refused.value) and "this one has 5" in str(refused.value)


class Clock:
    now = 1e9

    def __call__(self):
        return self.now


@pytest.mark.server
def test_the_server_pins_each_marked_prefix_for_its_own_ttl(tiny_chat):
    """Through HTTP: the first prefix's blocks are pinned for an hour, the rest of the second's for 5 minutes
    (before, the last mark alone set the pins: an hour's mark lasted 5 minutes); 5 marks are a 400."""
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64, kv_offload_memory="16MiB") as url:
        offload = app_of(url).state.async_engine.engine.offload
        offload.clock = offload.host.clock = Clock()
        reply = post(url, "chat/completions", {"messages": TWO_MARKS, "max_tokens": 2, "temperature": 0})
        chat = protocol.ChatCompletionRequest.model_validate({"messages": TWO_MARKS}).messages
        chat = [m.as_template_message() for m in chat]
        first, second = (len(chat_ids(tokenizer, chat[:n], add_generation_prompt=False)) // BLOCK for n in (1, 2))
        hashes = block_hashes(chat_ids(tokenizer, chat), BLOCK, model_seed(model))[:second]
        assert offload.pins == {h: Clock.now + (3600 if i < first else 300) for i, h in enumerate(hashes)}
        assert 0 < first < second and reply["usage"]["cache_creation_input_tokens"] == second * BLOCK
        five = [dict(m, cache_control={"type": "ephemeral"}) for m in TWO_MARKS[:3]]  # 2 + 1 + 1 + 1 marks
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": five + TWO_MARKS[3:]}, timeout=TIMEOUT_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.2.cache_control"


@pytest.mark.server
def test_cache_control_writes_then_reads_its_prefix(server, tiny_chat):
    _, tokenizer = tiny_chat
    system = {"role": "system", "content": DOCUMENT, "cache_control": {"type": "ephemeral"}}
    ask = [{"role": "user", "content": "Which river is longest?"}, {"role": "user", "content": "And the shortest?"}]
    first = post(server, "chat/completions", {"messages": [system, ask[0]], "max_tokens": 2, "temperature": 0})
    second = post(server, "chat/completions", {"messages": [system, ask[1]], "max_tokens": 2, "temperature": 0})
    point = len(chat_ids(tokenizer, [{"role": "system", "content": DOCUMENT}], add_generation_prompt=False))
    # Anthropic's count: the point's tokens not read from a cache, in full blocks (a partial block has no hash)
    assert first["usage"]["cache_creation_input_tokens"] == BLOCK * (point // BLOCK) > 0
    assert first["usage"]["cache_read_input_tokens"] == 0
    shared = common_prefix_len(chat_ids(tokenizer, [system, ask[0]]), chat_ids(tokenizer, [system, ask[1]]))
    read = second["usage"]["cache_read_input_tokens"]
    assert read == second["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCK * (shared // BLOCK) >= point - 15
    assert second["usage"]["cache_creation_input_tokens"] == 0  # the point's blocks were all read


@pytest.mark.server
def test_cache_control_on_completions_marks_the_whole_prompt_and_shows_in_streamed_usage(server):
    body = {"prompt": PROMPT_IDS, "max_tokens": 3, "temperature": 0, "cache_control": {"type": "ephemeral"},
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["cache_creation_input_tokens"] == BLOCK * (len(PROMPT_IDS) // BLOCK) == 32
    assert usage["cache_read_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] == 0
    plain = completion(server)  # no mark: nothing written, the marked prompt's blocks read
    assert plain["usage"]["cache_creation_input_tokens"] == 0 and plain["usage"]["cache_read_input_tokens"] == 32


# -- a restart -----------------------------------------------------------------------------------


def test_closing_the_server_closes_the_engine(tiny_chat, monkeypatch):
    """AsyncEngine.close (``minillm serve``'s shutdown, live_server's exit) ends with engine.close(), which
    writes the blocks that must outlive the process to the disk tier."""
    model, tokenizer = tiny_chat
    engine, closed = LLMEngine(model, tokenizer, num_blocks=8), []
    monkeypatch.setattr(engine, "close", lambda: closed.append(engine.has_unfinished_requests()))
    AsyncEngine(engine).close()
    assert closed == [False]  # once, after the requests were ended


@pytest.mark.server
def test_a_restarted_server_answers_from_the_disk_tier_as_a_cold_run(tiny_chat, tmp_path):
    model, tokenizer = tiny_chat
    prompt_ids = list(range(2000, 2100))  # 100 tokens: 6 full blocks can hit
    with live_server(model, tokenizer, num_blocks=64, kv_offload_dir=tmp_path) as url:
        before = completion(url, prompt=prompt_ids)
    # the with-block closed the engine: its blocks are on disk now
    with live_server(model, tokenizer, num_blocks=64, kv_offload_dir=tmp_path) as url:
        after = completion(url, prompt=prompt_ids)
    assert before["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCK * ((len(prompt_ids) - 1) // BLOCK)
    assert after["choices"][0]["text"] == before["choices"][0]["text"] == alone(tiny_chat, prompt_ids)
