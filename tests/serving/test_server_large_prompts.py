"""A prompt too large for the context is refused from its length alone, before it is tokenised
(issue 31, item 1): tokenising megabytes would hold up every other request for seconds. What is
tokenised runs without the GIL, so the event loop and the engine thread keep going meanwhile."""

import threading

import httpx
import pytest
from live_server import app_of, live_server

TIMEOUT_S = 120.0
CONTEXT = 512  # tiny_chat's max_position_embeddings
MiB = 2**20


@pytest.fixture(scope="module")
def server(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64) as url:
        yield url


@pytest.fixture
def encoded(server, monkeypatch):
    """The lengths of the texts the server's tokenizer is asked to encode, in order."""
    tokenizer = app_of(server).state.tokenizer
    lengths, encode = [], tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **kw: lengths.append(len(text)) or encode(text, *a, **kw))
    return lengths


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
    return error["message"]


@pytest.mark.parametrize("size", [4 * MiB, 31 * MiB])
def test_a_huge_prompt_is_refused_untokenised(server, encoded, size):
    text = "x" * size
    message = refused(httpx.post(f"{server}/v1/completions", json={"prompt": text}, timeout=TIMEOUT_S), "prompt")
    assert f"{size:,} characters" in message and f"{CONTEXT} tokens" in message
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]}
    refused(httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=TIMEOUT_S), "messages")
    assert encoded == []


def test_a_prompt_the_bound_lets_through_is_counted_exactly(server, encoded):
    """Under the bound (512 tokens x 81 characters x 4) the tokens decide: 20,000 words are
    20,000 tokens, over the context, and the message gives the exact count."""
    tokenizer = app_of(server).state.tokenizer
    text = " hello" * 20_000
    assert len(text) <= CONTEXT * tokenizer.max_token_chars * 4
    message = refused(httpx.post(f"{server}/v1/completions", json={"prompt": text}, timeout=TIMEOUT_S), "prompt")
    assert f"the prompt is {len(tokenizer.encode(text))} tokens" in message
    assert encoded[0] == len(text)


def test_max_token_chars_is_the_longest_vocabulary_entry(tiny_chat):
    _, tokenizer = tiny_chat
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    assert tokenizer.max_token_chars == max(map(len, vocab)) == 81  # SmolLM2's: a run of spaces or dashes


def counted_while(fn) -> int:
    """How many times another thread got round its loop while ``fn()`` ran."""
    started, done, counted = threading.Event(), threading.Event(), [0]

    def count():
        started.set()
        while not done.is_set():
            counted[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    started.wait()
    before = counted[0]
    fn()
    during = counted[0] - before
    done.set()
    thread.join()
    return during


def test_encoding_lets_other_threads_run(tiny_chat):
    """The tokenizer releases the GIL while it encodes: a thread counting while a 1 MiB text is
    encoded gets round its loop far more often than while the GIL-holding ``encode`` of the
    tokenizers library runs (60-100x here). Iterations against iterations, not seconds: a busy
    machine slows both alike."""
    _, tokenizer = tiny_chat
    text = "The quick brown fox jumps over the lazy dog. " * 24_000
    assert tokenizer.encode(text) == tokenizer.backend.encode(text).ids
    released = counted_while(lambda: tokenizer.encode(text))
    held = counted_while(lambda: tokenizer.backend.encode(text))
    assert released > 10 * held, (released, held)
