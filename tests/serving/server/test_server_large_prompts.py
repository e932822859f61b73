"""A prompt too large for the context is refused from its length alone, before it is tokenised
(issue 31, item 1): tokenising megabytes would hold up every other request for seconds. What is
tokenised runs without the GIL, so the event loop and the engine thread keep going meanwhile.
Under that bound (a context of 8,192 tokens lets 2.6 M characters through) a prompt is refused
from a prefix's pieces, and the memory its tokenising took is given back (issue 40, item 4)."""

import os
import shutil
import threading

import httpx
import pytest
from live_server import app_of, live_server, start_serve
from tiny_models import CONFIGS, build_hf, save_hf

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


@pytest.mark.server
@pytest.mark.parametrize("size", [4 * MiB, 31 * MiB])
def test_a_huge_prompt_is_refused_untokenised(server, encoded, size):
    text = "x" * size
    message = refused(httpx.post(f"{server}/v1/completions", json={"prompt": text}, timeout=TIMEOUT_S), "prompt")
    assert f"{size:,} characters" in message and f"{CONTEXT} tokens" in message
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]}
    refused(httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=TIMEOUT_S), "messages")
    assert encoded == []


@pytest.mark.server
def test_a_prompt_the_bound_lets_through_is_refused_from_a_prefix(server, encoded):
    """Under the bound (512 tokens x 81 characters x 4) a prefix decides (Tokenizer.tokens_at_least):
    20,000 words are refused as at least 683 tokens from the first 4,096 characters' pieces,
    and the text is never tokenised. A text of up to 8 characters per token of the context is
    tokenised, and the message gives its exact count."""
    tokenizer = app_of(server).state.tokenizer
    text = " hello" * 20_000
    assert len(text) <= CONTEXT * tokenizer.max_token_chars * 4
    message = refused(httpx.post(f"{server}/v1/completions", json={"prompt": text}, timeout=TIMEOUT_S), "prompt")
    assert "the prompt is 120,000 characters, at least 683 tokens" in message and encoded == []
    text = " hello" * 600
    message = refused(httpx.post(f"{server}/v1/completions", json={"prompt": text}, timeout=TIMEOUT_S), "prompt")
    assert f"the prompt is {len(tokenizer.encode(text))} tokens" in message and encoded[0] == len(text)


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


# -- under the length bound: `minillm serve` (its malloc policy too) at SmolLM2's context ------------

LONG_CONTEXT = 8192
PROMPT_CHARS = int(2.4 * MiB)  # the issue's prompt: under 8,192 x 81 x 4 characters, tokenised before
# What RSS may grow by across a refused 2.4 MiB prompt: measured -26 .. +6 MiB (once +60) after the
# change, +250 to +270 MiB for each kind of prompt before it (the tokenizer's buffers, kept by the
# malloc policy).
RSS_MARGIN_MIB = 64
TEXTS = {"words": ("The quality of mercy is not strained; it droppeth as the gentle rain. " * 40_000)[:PROMPT_CHARS],
         "one long word": ("abcdefghijklmnopqrstuvwxyz" * 100_000)[:PROMPT_CHARS]}


@pytest.fixture(scope="module")
def long_context_server(tmp_path_factory, smollm2_dir):
    """`minillm serve` in a subprocess on a tiny random model with SmolLM2's vocabulary, tokenizer
    and 8,192 positions: (base URL, its pid)."""
    family, kwargs = CONFIGS["llama_gqa"]
    kwargs = dict(kwargs, vocab_size=49152, max_position_embeddings=LONG_CONTEXT, bos_token_id=1, eos_token_id=2)
    folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("tiny_8k"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    server, url = start_serve(folder, kv_cache_memory="16MiB", timeout_s=TIMEOUT_S)
    try:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == LONG_CONTEXT
        yield url, server.pid
    finally:
        server.terminate()
        server.wait(TIMEOUT_S)


def rss_mib(pid: int) -> float:
    """The process's resident memory (/proc/PID/statm's second field, pages), in MiB."""
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.server
@pytest.mark.parametrize("kind", TEXTS)
@pytest.mark.parametrize("endpoint, param", [("completions", "prompt"), ("chat/completions", "messages")])
def test_a_prompt_of_megabytes_is_refused_from_a_prefix_and_its_memory_given_back(long_context_server, kind,
                                                                                  endpoint, param):
    """2.4 MiB of text (words, or one word of 2.4 M letters, which BPE takes longest over) at a
    context of 8,192: refused naming its field, from a prefix's pieces (was: the whole text
    tokenised, 1.6-2.2 s of CPU here and 13 s in the issue, and RSS +250-270 MiB that stayed).
    The CPU time is printed, not asserted: a busy machine slows it."""
    url, pid = long_context_server
    text = TEXTS[kind]
    body = {"prompt": text} if param == "prompt" else {"messages": [{"role": "user", "content": text}]}
    httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=TIMEOUT_S)  # the first: the piece splitter is built
    rss_before, cpu_before = rss_mib(pid), cpu_s(pid)
    message = refused(httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=TIMEOUT_S), param)
    cpu, rss_after = cpu_s(pid) - cpu_before, rss_mib(pid)
    print(f"{kind}, {endpoint}: {cpu:.2f} s of the server's CPU; RSS {rss_before:.0f} -> {rss_after:.0f} MiB")
    assert f"the prompt is {len(text):,} characters" in message or param == "messages"
    assert "at least" in message and f"{LONG_CONTEXT} tokens" in message
    assert rss_after <= rss_before + RSS_MARGIN_MIB
