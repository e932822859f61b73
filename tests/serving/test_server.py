"""minillm serve's HTTP API on a tiny random model (tests/serving/live_server.py runs the server)."""

import httpx
import pytest
from live_server import live_server

import minillm

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=128) as url:
        yield url


def greedy_ids(tiny_chat, prompt_ids, n):
    model, _ = tiny_chat
    params = minillm.SamplingParams(max_new_tokens=n)
    return [step.token_id for step in minillm.generate(model, prompt_ids, params)]


def test_health(server):
    assert httpx.get(f"{server}/health", timeout=TIMEOUT_S).json() == {"status": "ok"}


def test_completion_equals_generate(server, tiny_chat):
    _, tokenizer = tiny_chat
    prompt = "The capital of France is"
    r = httpx.post(f"{server}/v1/completions", timeout=TIMEOUT_S,
                   json={"model": "minillm-test", "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.encode(prompt)
    expected = greedy_ids(tiny_chat, ids, 6)
    assert body["choices"][0]["text"] == tokenizer.decode(expected)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": len(ids) + 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
