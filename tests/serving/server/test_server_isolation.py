"""No request can harm another through the server: hostile structured-output constraints, a constraint
that fails mid-stream, and a step that fails with no owner, each sent while three users stream chats.

The oracle for the victims: the same three streams on the same server with nothing else running.
A hostile request gets its own error (a 400 naming its field, or a stream's error event and
``[DONE]``); the victims' texts equal the quiet run's, and /health answers as it should."""

import json
import threading

import httpx
import pytest
from constraints import FailsAfter
from live_server import app_of, live_server, wait_until

from minillm.serving.server.routes import completions

pytest.importorskip("llguidance")

TIMEOUT_S = 120.0
VICTIM_TOKENS = 40
QUESTIONS = ["Tell me about the sea.", "Name three colours.", "Why is the sky blue?"]

HOSTILE = {  # the review's requests: a constraint that compiles but cannot run (issue 40)
    "json_schema pattern": ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}}),
    "guided_regex": ("guided_regex", {"guided_regex": "(a{1000}){1000}"}),
    "structured_outputs.regex": ("structured_outputs", {"structured_outputs": {"regex": "(a{1000}){1000}"}}),
    "lark": ("guided_grammar", {"guided_grammar": 'start: /(a{1000}){1000}/'}),
    "unsatisfiable regex": ("guided_regex", {"guided_regex": r"[^\s\S]"}),
}


@pytest.fixture(scope="module")
def server(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=256, block_size=16) as url:
        yield url


def stream_chat(url: str, question: str, extra: dict | None = None) -> tuple[str, list[dict]]:
    """A greedy chat stream of VICTIM_TOKENS tokens: (its text, its error events)."""
    body = {"messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": VICTIM_TOKENS,
            "ignore_eos": True, "stream": True, **(extra or {})}
    text, errors, done = [], [], False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"])
                else:
                    text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    assert done, "the stream ended without [DONE]"
    return "".join(text), errors


def victims_while(url: str, hostile) -> list[str]:
    """The three victims' texts, streamed concurrently while ``hostile()`` runs in this thread."""
    answers, started = [None] * len(QUESTIONS), threading.Barrier(len(QUESTIONS) + 1)

    def victim(i):
        started.wait()
        answers[i], errors = stream_chat(url, QUESTIONS[i])
        assert errors == []

    threads = [threading.Thread(target=victim, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    started.wait()
    hostile()
    for t in threads:
        t.join(TIMEOUT_S)
    assert all(a is not None for a in answers)
    return answers


@pytest.fixture(scope="module")
def quiet(server):
    return [stream_chat(server, q)[0] for q in QUESTIONS]


@pytest.mark.server
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_constraint_is_refused_and_the_others_stream_on(server, quiet, case):
    field, fields = HOSTILE[case]
    replies = []

    def hostile():
        for _ in range(3):  # again and again, as the review did
            replies.append(httpx.post(f"{server}/v1/chat/completions", timeout=TIMEOUT_S, json={
                "messages": [{"role": "user", "content": "Say a."}], "max_tokens": 30, **fields}))

    assert victims_while(server, hostile) == quiet
    for reply in replies:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == field and "\n" not in error["message"]
    assert httpx.get(f"{server}/health", timeout=TIMEOUT_S).status_code == 200


@pytest.mark.server
def test_a_real_grammar_that_passes_admission_and_fails_mid_stream_ends_alone(server, quiet):
    """Two free letters, then the hostile lexeme: admitted (its first masks are cheap), it runs out of lexer
    fuel once the letters are out, inside a step; that request alone fails, with its field named."""
    outcome = {}
    grammar = {"guided_grammar": "start: /[xy][xy]/ /(a{1000}){1000}/"}

    def hostile():
        outcome["stream"] = stream_chat(server, "Hello", grammar)
        outcome["plain"] = httpx.post(f"{server}/v1/chat/completions", timeout=TIMEOUT_S, json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20, **grammar})

    assert victims_while(server, hostile) == quiet
    text, (error,) = outcome["stream"]
    assert 1 <= len(text) <= 2 and set(text) <= {"x", "y"}  # the token it could not take is not shown
    assert error["param"] == "guided_grammar" and error["code"] == "request_failed"
    assert "lexer fuel" in error["message"] and "\n" not in error["message"]
    assert outcome["plain"].status_code == 400 and outcome["plain"].json()["error"]["param"] == "guided_grammar"


@pytest.mark.server
def test_a_constraint_failing_mid_stream_ends_that_stream_alone(server, quiet, monkeypatch):
    """A constraint that passes admission and fails at its 5th token (a grammar exhausting its budget
    mid-stream): its stream gets an error event naming its field, then [DONE]; a non-streaming one a 400."""
    vocab = app_of(server).state.async_engine.engine.model.config.vocab_size
    real = completions.compile_grammar
    monkeypatch.setattr(completions, "compile_grammar",
                        lambda body, *a: FailsAfter(5, vocab) if body.guided_regex == "x" else real(body, *a))
    outcome = {}

    def hostile():
        outcome["stream"] = stream_chat(server, "Hello", {"guided_regex": "x"})
        outcome["plain"] = httpx.post(f"{server}/v1/chat/completions", timeout=TIMEOUT_S, json={
            "messages": [{"role": "user", "content": "Hello"}], "guided_regex": "x", "max_tokens": 20})

    assert victims_while(server, hostile) == quiet
    _, (error,) = outcome["stream"]
    assert error["param"] == "guided_regex" and error["code"] == "request_failed"
    assert "after 5 output tokens" in error["message"] and "lexer fuel exhausted" in error["message"]
    assert outcome["plain"].status_code == 400 and outcome["plain"].json()["error"]["param"] == "guided_regex"
    assert httpx.get(f"{server}/health", timeout=TIMEOUT_S).status_code == 200


@pytest.mark.server
def test_a_failed_step_with_no_owner_is_in_health_until_a_step_succeeds(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64) as url:
        engine = app_of(url).state.async_engine.engine
        real_step = engine.step
        engine.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=TIMEOUT_S)
        assert reply.status_code == 500 and "device lost" in reply.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=TIMEOUT_S)
        assert health.status_code == 503 and "RuntimeError: device lost" in health.json()["error"]["message"]
        engine.step = real_step
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=TIMEOUT_S)
        assert reply.status_code == 200
        wait_until(lambda: httpx.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200)
