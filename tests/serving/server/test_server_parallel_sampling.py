"""Parallel sampling over HTTP: ``n`` choices from one prompt, as the openai client asks for them.

The n sequences share the prompt's prefill (tests/serving/test_engine_parallel_sampling.py checks
the blocks); here: the choices carry indexes 0..n-1, greedy choices equal the single answer, seeded
ones are reproducible and differ, streamed chunks interleave and each index ends with its
finish_reason, and ``usage`` counts the prompt once.
"""

import json

import httpx
import openai
import pytest
from live_server import app_of, live_server, wait_until
from prometheus_client.parser import text_string_to_metric_families

import minillm

TIMEOUT_S = 60.0
MODEL = "minillm-test"
PROMPT = "The quick brown fox"
N = 3


@pytest.fixture(scope="module")
def server(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, model_name=MODEL, num_blocks=128, block_size=4) as url:
        yield url


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


def pool_is_free(server) -> bool:
    pool = app_of(server).state.async_engine.engine.cache.allocator
    return pool.num_used_blocks == 0 and not pool.block_tables


@pytest.mark.server
def test_greedy_n_choices_equal_the_single_answer_and_usage_counts_the_prompt_once(server, client, tiny_chat):
    model, tokenizer = tiny_chat
    ids = tokenizer.encode(PROMPT)
    alone = "".join(s.text for s in minillm.generate(model, ids, minillm.SamplingParams(max_new_tokens=6),
                                                      tokenizer=tokenizer))
    reply = client.completions.create(model=MODEL, prompt=PROMPT, n=N, max_tokens=6, temperature=0)
    assert [c.index for c in reply.choices] == list(range(N))
    assert [c.text for c in reply.choices] == [alone] * N
    assert [c.finish_reason for c in reply.choices] == ["length"] * N
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        len(ids), N * 6, len(ids) + N * 6)
    wait_until(lambda: pool_is_free(server))


@pytest.mark.server
def test_seeded_choices_are_reproducible_and_differ(client):
    def texts():
        reply = client.completions.create(model=MODEL, prompt=PROMPT, n=N, max_tokens=8, temperature=1.0, seed=5)
        return [c.text for c in reply.choices]

    first = texts()
    assert texts() == first
    assert len(set(first)) == N
    single = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5)
    assert first[0] == single.choices[0].text  # choice i samples with seed + i: choice 0 is the n = 1 answer


@pytest.mark.server
def test_chat_stream_interleaves_indexes_each_ending_with_its_finish_reason(server, client):
    messages = [{"role": "user", "content": "Hi"}]
    kwargs = dict(model=MODEL, messages=messages, n=N, max_tokens=5, temperature=1.0, seed=9)
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == list(range(N))
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts, finished = {i: "" for i in range(N)}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert choice.index not in finished  # nothing after a choice's finish_reason
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert finished == {i: "length" for i in range(N)}
    assert [texts[i] for i in range(N)] == [c.message.content for c in whole.choices]
    roles = [c.choices[0].index for c in chunks[:N]]
    assert roles == list(range(N)) and all(c.choices[0].delta.role == "assistant" for c in chunks[:N])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == whole.usage.prompt_tokens  # (now cached)
    assert usage.completion_tokens == whole.usage.completion_tokens == N * 5
    wait_until(lambda: pool_is_free(server))


@pytest.mark.server
def test_completions_stream_with_continuous_usage_sums_every_choice(server):
    body = {"model": MODEL, "prompt": PROMPT, "n": N, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    completion_tokens = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == N * 4
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    indexes = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert sorted(set(indexes)) == list(range(N)) and len(indexes) == N * 4


@pytest.mark.server
def test_metrics_count_the_prompt_once_and_every_generated_token(server, client):
    def counters():
        text = httpx.get(f"{server}/metrics", timeout=TIMEOUT_S).text
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        return values["minillm:prompt_tokens_total"], values["minillm:generation_tokens_total"]

    wait_until(lambda: pool_is_free(server))
    before = counters()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, n=N, max_tokens=3, temperature=0)
    wait_until(lambda: counters()[1] - before[1] == N * 3)
    assert counters()[0] - before[0] == reply.usage.prompt_tokens
