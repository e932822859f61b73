"""minillm serve's OpenAI API, through the official `openai` client and raw HTTP, on a tiny random
model with SmolLM2's tokenizer (tests/conftest.py: tiny_chat). The oracle is
`minillm.generate` alone on the same model: the server's answers must equal it token for token.
"""

import asyncio
import json
import logging
import threading
import time

import httpx
import openai
import pytest
from live_server import app_of, live_server, wait_until
from prometheus_client.parser import text_string_to_metric_families

import minillm
from minillm.serving.server.async_engine import AsyncEngine
from minillm.serving.engine import LLMEngine

TIMEOUT_S = 60.0
MODEL = "minillm-test"


@pytest.fixture(scope="module")
def server(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, model_name=MODEL, num_blocks=128) as url:
        yield url


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


def alone(tiny_chat, prompt_ids, **params):
    """generate() alone: (token ids, text) with stop strings cut, as the server should answer."""
    model, tokenizer = tiny_chat
    steps = list(minillm.generate(model, prompt_ids, minillm.SamplingParams(**params), tokenizer=tokenizer))
    return [s.token_id for s in steps], "".join(s.text for s in steps), steps


def chat_ids(tokenizer, messages):
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


@pytest.mark.server
def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health", timeout=TIMEOUT_S).json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


# a body each POST route serves, and one it refuses (the routes read their bodies themselves)
BODIES = {"/v1/completions": ({"prompt": "Hi", "max_tokens": 2, "logit_bias": {"5": -100}}, {"prompt": 5}),
          "/v1/chat/completions": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
                                   {"messages": [{"role": "robot", "content": "Hi"}]}),
          "/tokenize": ({"prompt": "Hi", "return_token_strs": True}, {"prompt": "Hi", "frobnicate": 1}),
          "/detokenize": ({"tokens": [1, 2]}, {"tokens": ["a"]})}


@pytest.mark.server
def test_openapi_documents_the_request_bodies(server):
    """/openapi.json (and so /docs) describes each POST route's body: protocol.py's model, nested
    models in components.schemas; a body the server serves fits it, one it refuses does not."""
    jsonschema = pytest.importorskip("jsonschema")
    document = httpx.get(f"{server}/openapi.json", timeout=TIMEOUT_S).json()
    for path, (served, refused) in BODIES.items():
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        schema = dict(schema, components=document["components"])  # its $refs: "#/components/schemas/..."
        jsonschema.validate(served, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(refused, schema)
        assert httpx.post(f"{server}{path}", json=served, timeout=TIMEOUT_S).status_code == 200
        assert httpx.post(f"{server}{path}", json=refused, timeout=TIMEOUT_S).status_code == 400


@pytest.mark.server
def test_models_retrieve_and_head_health(server, client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "minillm")
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    error = caught.value.body  # OpenAI's error JSON, the "error" object
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "'gpt-9' does not exist" in error["message"]
    head = httpx.head(f"{server}/health", timeout=TIMEOUT_S)
    assert head.status_code == 200 and head.content == b""


# fields that change nothing (OpenAI's bookkeeping, tools turned off): accepted as vLLM accepts them
IGNORED = {"store": True, "metadata": {"project": "minillm"}, "user": "user-42", "parallel_tool_calls": False,
           "tools": [], "tool_choice": "none"}


@pytest.mark.server
@pytest.mark.parametrize("field", IGNORED)
def test_a_field_that_changes_nothing_gives_the_same_answer_and_a_log_line(client, caplog, field):
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    with caplog.at_level(logging.WARNING, logger="minillm.serving.server.admission"):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                           **{field: IGNORED[field]})
    assert r.choices[0].message.content == plain.choices[0].message.content
    (line,) = [rec.getMessage() for rec in caplog.records if rec.name == "minillm.serving.server.admission"]
    assert line.startswith("POST /v1/chat/completions: ignored fields") and line.endswith(f": {field}")


@pytest.mark.server
def test_all_the_ignored_fields_at_once_and_user_on_completions(client, caplog):
    with caplog.at_level(logging.WARNING, logger="minillm.serving.server.admission"):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0, **IGNORED)
        plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, user="user-42")
    assert r.usage.completion_tokens == 3 and c.choices[0].text == plain.choices[0].text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "minillm.serving.server.admission"]
    assert lines == ["POST /v1/chat/completions: ignored fields (accepted as OpenAI's clients send them; they "
                     "change nothing here): metadata, parallel_tool_calls, store, tool_choice, tools, user",
                     "POST /v1/completions: ignored fields (accepted as OpenAI's clients send them; they change "
                     "nothing here): user"]


@pytest.mark.server
def test_completion_equals_generate(client, tiny_chat):
    _, tokenizer = tiny_chat
    prompt = "The capital of France is"
    ids, text, _ = alone(tiny_chat, tokenizer.encode(prompt), max_new_tokens=6)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert r.choices[0].text == text == tokenizer.decode(ids)
    assert r.choices[0].finish_reason == "length"
    n = len(tokenizer.encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n, 6, n + 6)
    # the same prompt as token ids (vLLM's extension), or as a batch of one, gives the same answer
    for same in (tokenizer.encode(prompt), [prompt], [tokenizer.encode(prompt)]):
        assert client.completions.create(model=MODEL, prompt=same, max_tokens=6, temperature=0).choices[0].text == text


@pytest.mark.server
def test_chat_completion_equals_generate_with_logprobs(client, tiny_chat):
    _, tokenizer = tiny_chat
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids, text, steps = alone(tiny_chat, chat_ids(tokenizer, messages), max_new_tokens=5)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, "length")
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, messages)) and r.usage.completion_tokens == 5
    content = choice.logprobs.content
    assert [c.token for c in content] == tokenizer.token_strings(ids)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == tokenizer.decode(ids)
    for c, step in zip(content, steps):  # generate's logprob: log_softmax of the raw logits
        assert c.logprob == pytest.approx(step.logprob, abs=1e-4)
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token  # greedy: the top token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)


@pytest.mark.server
def test_chat_text_parts_and_developer_role(client, tiny_chat):
    """Content as OpenAI's text parts is joined by newlines, "developer" is "system" (vLLM's reading)."""
    _, tokenizer = tiny_chat
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
    _, text, _ = alone(tiny_chat, chat_ids(tokenizer, plain), max_new_tokens=4)
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4, temperature=0)
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, plain))


@pytest.mark.server
def test_streaming_with_usage(server, client, tiny_chat):
    _, tokenizer = tiny_chat
    messages = [{"role": "user", "content": "Tell me a story."}]
    ids, text, _ = alone(tiny_chat, chat_ids(tokenizer, messages), max_new_tokens=7)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = [c for c in chunks[1:] if c.choices]
    assert len(token_chunks) == 7  # one chunk per generated token
    assert "".join(c.choices[0].delta.content or "" for c in token_chunks) == text
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 6 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == len(chat_ids(tokenizer, messages))
    # raw SSE: "data: {...}" events, the last one "data: [DONE]"
    with httpx.stream("POST", f"{server}/v1/completions", timeout=TIMEOUT_S,
                      json={"prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == alone(
        tiny_chat, tokenizer.encode("Hi"), max_new_tokens=3)[1]


@pytest.mark.server
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_continuous_usage_stats_put_the_counts_so_far_on_every_chunk(server, tiny_chat, endpoint):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it on every streaming request):
    each chunk carries the usage so far, completion_tokens counting up one a token; the chat's role
    chunk counts the prompt alone; the last chunk is the usual usage chunk (issue 31, item 3)."""
    _, tokenizer = tiny_chat
    prompt = {"prompt": "Hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    body = dict(prompt, max_tokens=5, temperature=0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    with httpx.stream("POST", f"{server}/v1/{endpoint}", json=body, timeout=TIMEOUT_S) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    n_prompt = chunks[-1]["usage"]["prompt_tokens"]
    counted = [c["usage"]["completion_tokens"] for c in chunks]
    assert counted == ([0] if endpoint == "chat/completions" else []) + [1, 2, 3, 4, 5, 5]
    assert all(c["usage"]["prompt_tokens"] == n_prompt for c in chunks)
    assert all(c["usage"]["total_tokens"] == n_prompt + c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == [] and all(c["choices"] for c in chunks[:-1])
    if endpoint == "completions":
        assert n_prompt == len(tokenizer.encode("Hi"))


GUIDELLM_STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
GUIDELLM_BODIES = {  # guidellm 0.8.1's requests, from backends/openai/request_handlers.py (format_completions, format_chat)
    "completions": dict(GUIDELLM_STREAM, prompt="Once upon a time", max_tokens=6, stop=None, ignore_eos=True),
    "chat/completions": dict(GUIDELLM_STREAM, max_completion_tokens=6, stop=None, ignore_eos=True, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}]),
}


@pytest.mark.server
@pytest.mark.parametrize("endpoint", GUIDELLM_BODIES)
def test_guidellms_streaming_request_is_served(server, endpoint):
    """guidellm's default streaming requests, as it sends them: 6 tokens, usage on every chunk."""
    with httpx.stream("POST", f"{server}/v1/{endpoint}", json=GUIDELLM_BODIES[endpoint], timeout=TIMEOUT_S) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is not None for c in chunks)


@pytest.mark.server
def test_continuous_usage_stats_alone_adds_no_usage(server):
    """vLLM's rule: continuous_usage_stats counts only with include_usage."""
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) == 2 and all("usage" not in c for c in chunks)


@pytest.mark.server
def test_stop_string(client, tiny_chat):
    _, tokenizer = tiny_chat
    prompt_ids = tokenizer.encode("Once upon a time")
    _, full, _ = alone(tiny_chat, prompt_ids, max_new_tokens=24)
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a piece of the greedy answer's middle
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=24, temperature=0,
                                  stop=["never-in-the-text", stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    streamed = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected  # no piece of the stop string leaks


@pytest.mark.server
def test_seed_reproducible(client, tiny_chat):
    _, tokenizer = tiny_chat
    prompt = "Pick a random word:"

    def sample(seed):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again == alone(tiny_chat, tokenizer.encode(prompt), max_new_tokens=8, temperature=1.0, seed=7)[1]
    assert other != first


@pytest.mark.server
def test_cached_tokens_on_a_repeated_long_prompt(client):
    prompt_ids = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16 can be reused
    first = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # at most len - 1 tokens hit (the last one's logits are needed), in whole blocks
    assert second.usage.prompt_tokens_details.cached_tokens == 16 * ((len(prompt_ids) - 1) // 16) == 32
    assert second.choices[0].text == first.choices[0].text


@pytest.mark.server
def test_eight_concurrent_streams_equal_their_single_answers_and_share_batches(server, tiny_chat):
    _, tokenizer = tiny_chat
    engine = app_of(server).state.async_engine.engine
    prompts = [f"Request number {i} asks about topic {i * 7}" for i in range(8)]
    expected = [alone(tiny_chat, tokenizer.encode(p), max_new_tokens=24)[1] for p in prompts]
    first_step, answers, barrier = len(engine.steps), [None] * 8, threading.Barrier(8)

    def run(i):
        with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
            barrier.wait(TIMEOUT_S)
            stream = c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=24, temperature=0, stream=True)
            answers[i] = "".join(chunk.choices[0].text for chunk in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert answers == expected
    assert max(len(step.scheduled) for step in engine.steps[first_step:]) > 1  # some step ran several requests


@pytest.mark.server
def test_requests_that_arrive_during_a_step_all_join_the_next(server):
    """Requests queue as commands while the engine holds its lock: the next step takes all four."""
    async_engine = app_of(server).state.async_engine
    engine, answers = async_engine.engine, []
    post = lambda i: answers.append(httpx.post(f"{server}/v1/completions", timeout=TIMEOUT_S,  # noqa: E731
                                               json={"prompt": f"Arrival {i}", "max_tokens": 2}).status_code)
    threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
    with async_engine.lock:  # as during a long step
        first_step = len(engine.steps)
        for t in threads:
            t.start()
        wait_until(lambda: len(async_engine._commands) == 4)
    for t in threads:
        t.join(TIMEOUT_S)
    assert answers == [200] * 4
    assert len(engine.steps[first_step].scheduled) == 4  # four prefills in one step


@pytest.mark.server
def test_disconnect_mid_stream_frees_the_blocks(server):
    async_engine = app_of(server).state.async_engine
    engine, pool = async_engine.engine, async_engine.engine.cache.allocator
    with async_engine.lock:
        free_before = pool.num_free_blocks
    body = {"prompt": list(range(2000, 2100)), "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        lines = (line for line in r.iter_lines() if line)
        request_id = json.loads(next(lines)[6:])["id"]
        next(lines)
        with async_engine.lock:
            assert pool.block_tables[request_id]  # it holds blocks while it streams
    # leaving the block closed the connection
    wait_until(lambda: engine.requests[request_id].finished)
    with async_engine.lock:
        request = engine.requests[request_id]
        assert request.finish_reason == "abort" and len(request.output_ids) < 400
        assert request_id not in pool.block_tables
        assert pool.num_free_blocks == free_before == pool.num_blocks
        assert all(block.ref_count == 0 for block in pool.blocks)


@pytest.mark.server
def test_metrics_count_the_requests_sent(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
            usages = []  # two 20-token prompts alike (the second hits 16 cached tokens), one of 3
            for prompt, n in ((list(range(300, 320)), 3), (list(range(300, 320)), 4), ([5, 6, 7], 5)):
                usages.append(c.completions.create(model="minillm-test", prompt=prompt, max_tokens=n, temperature=0,
                                                   extra_body={"ignore_eos": True}).usage)
            stream = c.chat.completions.create(model="minillm-test", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2, stream=True, stream_options={"include_usage": True})
            usages.append([chunk for chunk in stream][-1].usage)
        text = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("minillm:request_success_total", finished_reason="length") == 4
    assert value("minillm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert value("minillm:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 3 + 4 + 5 + 2
    assert value("minillm:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert value("minillm:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages) == 16
    assert value("minillm:time_to_first_token_seconds_count") == 4
    assert value("minillm:e2e_request_latency_seconds_count") == 4
    assert value("minillm:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert value("minillm:time_to_first_token_seconds_bucket", le="+Inf") == 4
    assert value("minillm:time_to_first_token_seconds_sum") > 0
    assert value("minillm:request_queue_time_seconds_count") == 4
    assert value("minillm:num_preemptions_total") == 0  # 64 blocks hold these four easily
    assert value("minillm:num_requests_running") == value("minillm:num_requests_waiting") == 0
    assert value("minillm:kv_cache_usage_perc") == 0


@pytest.mark.server
def test_metrics_count_preemptions_in_a_small_pool(tiny_chat):
    """Three requests of 5 blocks each in a pool of 8: the scheduler preempts, /metrics counts it."""
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=8) as url:
        def post(i):
            httpx.post(f"{url}/v1/completions", timeout=TIMEOUT_S,
                       json={"prompt": list(range(100 * i, 100 * i + 20)), "max_tokens": 60, "ignore_eos": True})

        async_engine = app_of(url).state.async_engine
        threads = [threading.Thread(target=post, args=(i,)) for i in range(1, 4)]
        with async_engine.lock:  # all three start in the same step
            for t in threads:
                t.start()
            wait_until(lambda: len(async_engine._commands) == 3)
        for t in threads:
            t.join(TIMEOUT_S)
        text = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
        engine = async_engine.engine
        preemptions = sum(r.num_preemptions for r in engine.requests.values())
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "minillm:num_preemptions"]
    assert family.samples[0].value == preemptions > 0


def test_async_engine_forgets_old_finished_requests_and_refuses_a_live_id(tiny_chat):
    """A server answers requests for days: only the newest max_finished_requests stay in engine.requests."""
    model, tokenizer = tiny_chat
    async_engine = AsyncEngine(LLMEngine(model, tokenizer, num_blocks=32), max_finished_requests=2)

    async def answer(request_id):
        params = minillm.SamplingParams(max_new_tokens=2)
        return [out async for out in async_engine.generate([5, 6, 7], params, request_id)][-1]

    async def same_id_twice():
        first = async_engine.generate([5, 6, 7], minillm.SamplingParams(max_new_tokens=50), "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="'dup' is already streaming"):
            await async_engine.generate([5], minillm.SamplingParams(max_new_tokens=2), "dup").__anext__()
        return [out async for out in first][-1]  # the first one is unharmed

    try:
        last = [asyncio.run(answer(f"r{i}")) for i in range(4)]
        assert len(asyncio.run(same_id_twice()).token_ids) == 50
    finally:
        async_engine.close()
    assert [out.token_ids for out in last] == [last[0].token_ids] * 4 and last[0].finish_reason == "length"
    assert list(async_engine.engine.requests) == ["r3", "dup"]


def test_async_engine_keeps_the_newest_step_records_numbered_on(tiny_chat):
    """A server steps for days: engine.steps keeps between max_step_records and twice as many, the newest, and
    their numbers go on counting every step the engine ran (one a generated token here, prefill included)."""
    model, tokenizer = tiny_chat
    async_engine = AsyncEngine(LLMEngine(model, tokenizer, num_blocks=32), max_step_records=3)

    async def answer(request_id):
        return [out async for out in async_engine.generate([5, 6, 7], minillm.SamplingParams(max_new_tokens=4),
                                                            request_id)][-1]

    try:
        for i in range(5):
            asyncio.run(answer(f"r{i}"))
    finally:
        async_engine.close()
    numbers = [record.step for record in async_engine.engine.steps]
    assert 3 <= len(numbers) <= 6
    assert numbers == list(range(20 - len(numbers), 20))  # 5 requests, one after another, 4 steps each


def test_a_requests_clock_starts_when_it_is_sent_not_when_the_engine_thread_adds_it(tiny_chat):
    """While the engine thread is busy (here: its lock held for 0.3 s), a new request waits in the
    command queue; its TTFT and queue time must include that wait, as a client sees it."""
    model, tokenizer = tiny_chat
    async_engine = AsyncEngine(LLMEngine(model, tokenizer, num_blocks=32))

    async def held_then_answered():
        async_engine.lock.acquire()
        sent = time.perf_counter()
        stream = async_engine.generate([5, 6, 7], minillm.SamplingParams(max_new_tokens=2), "late")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.3)
        released = time.perf_counter()
        async_engine.lock.release()
        await first
        return sent, released, [out async for out in stream]

    try:
        sent, released, _ = asyncio.run(held_then_answered())
    finally:
        async_engine.close()
    request = async_engine.engine.requests["late"]
    # stamped at generate(), before the wait; scheduled only once the engine thread could run: an order,
    # not a duration, so a loaded machine cannot break it
    assert sent <= request.arrival_s < released <= request.first_scheduled_s


def test_assistant_tool_calls_in_history_reach_a_template_that_renders_them():
    """An assistant turn's tool_calls and the tool's answer, as agent frameworks send the history:
    Qwen3's template renders both (issue 31, item 6); SmolLM2's renders none, a 400 (test_server_errors)."""
    from pathlib import Path

    from minillm.serving.server.admission import check_tool_calls_render
    from minillm.serving.server.protocol import ChatCompletionRequest

    tokenizer = minillm.load_tokenizer("smollm2-135m-instruct")
    tokenizer.chat_template = (Path(__file__).parents[2] / "chat_templates" / "qwen3.jinja").read_text()
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]})
    chat = [m.as_template_message() for m in body.messages]
    check_tool_calls_render(chat, tokenizer)
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text


def test_chat_template_kwargs_reach_the_template():
    """vLLM's ``chat_template_kwargs``: {"enable_thinking": false} with Qwen3's template (ChatML, as
    SmolLM2's tokenizer is) opens the answer with an empty thought."""
    from pathlib import Path

    from minillm.serving.server.admission import chat_prompt_ids
    from minillm.serving.server.protocol import ChatCompletionRequest

    tokenizer = minillm.load_tokenizer("smollm2-135m-instruct")
    tokenizer.chat_template = (Path(__file__).parents[2] / "chat_templates" / "qwen3.jinja").read_text()
    body = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": false}}')
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    chat = [m.as_template_message() for m in body.messages]
    assert chat_prompt_ids(tokenizer, chat, body.chat_template_kwargs, 512) == tokenizer.encode(
        expected, add_special_tokens=False)
