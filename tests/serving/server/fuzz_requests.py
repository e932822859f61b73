"""Hostile requests for `minillm serve`, generated from its own OpenAPI document (schemathesis).

    stream = QuietStream(url)                     # a greedy stream's tokens on the quiet server
    stream.start()                                # ... sent again and again from now on
    statuses, problems = fuzz(url, app, "minillm-test", seconds=60, max_examples=2500)
    stream.stop()                                 # stream.mismatches: runs whose tokens differed

schemathesis reads the app's /openapi.json (the request bodies are protocol.py's models) and
generates cases for every route: positive ones fit the schema (many are still refused: a random
model name, a logit_bias key that is not a token id, a regex that does not compile), negative
ones break it on purpose (a string for a number, a missing field, an extra one). The rules every
answer must keep (:func:`what_is_wrong`):

    any status            not a 5xx: a request can be wrong, the server cannot
    4xx                   OpenAI's error JSON {"error": {"message", "type", "param", "code"}}, one line
    400/404 of a JSON     ``param`` names the field at fault: its first part is a field of the
      object body         route's model (or a key the body sent: an unknown field), as
                          protocol.validation_message names pydantic's complaints

A :class:`QuietStream` loops one greedy chat stream through the fuzzing: each run's tokens must
equal the same request's on the quiet server (no hostile request may change another's answer).
Used by tests/serving/server/test_server_fuzz.py (a bounded run in CI) and benchmarks/fuzz_server.py (minutes).
"""

from __future__ import annotations

import collections
import json
import threading
import time

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from minillm.serving.server import protocol

# the body model of each POST route: a param must name one of its fields
BODY_MODELS = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
               "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest}
GENERATING = ("/v1/completions", "/v1/chat/completions")
MAX_TOKENS = 8  # positive cases generate at most this many tokens: the fuzzer is after the HTTP layer


def openapi_schema(app):
    """The app's OpenAPI document as schemathesis' schema (no HTTP: read from the app object)."""
    return schemathesis.openapi.from_dict(app.openapi())


def request_cases(schema, model_name: str) -> st.SearchStrategy:
    """Cases for every route of ``schema``, positive and negative. A positive case asks for few
    tokens; it names the served model, another one, or none (else nearly all would be 404s); and
    half of the generating ones get a plain prompt (a user's "Hi"), so that their sampling fields
    reach the engine instead of a chat template refusing random messages."""
    positive = st.tuples(schema.as_strategy(GenerationMode.POSITIVE), st.sampled_from(["keep", "served", "none"]),
                         st.booleans())
    return st.one_of(positive.map(lambda drawn: _small(*drawn, model_name)),
                     schema.as_strategy(GenerationMode.NEGATIVE))


def _small(case, model_choice: str, plain_prompt: bool, model_name: str):
    body = case.body
    if case.operation.path not in BODY_MODELS or not isinstance(body, dict):
        return case
    if model_choice == "served":
        body["model"] = model_name
    elif model_choice == "none":
        body.pop("model", None)
    if case.operation.path in GENERATING:
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS  # else: the rest of the context
        if plain_prompt:
            body.update({"messages": [{"role": "user", "content": "Hi"}]} if "messages" in body else {"prompt": "Hi"})
            for key in ("tools", "tool_choice"):
                body.pop(key, None)
    return case


def what_is_wrong(case, response) -> str | None:
    """None when ``response`` keeps the rules (the module docstring), else what it broke, in one line."""
    status = response.status_code
    if status >= 500:
        return f"{status}: {response.text[:300]}"
    if status < 400 or status == 499:
        return None
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without OpenAI's error JSON: {response.text[:200]!r}"
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"{status} error with fields {sorted(error) if isinstance(error, dict) else error!r}"
    if not isinstance(error["message"], str) or not error["message"] or "\n" in error["message"]:
        return f"{status} error message not one line: {error['message']!r:.200}"
    model_class = BODY_MODELS.get(case.operation.path)
    if model_class is None or case.method.upper() != "POST" or status not in (400, 404):
        return None
    body = _sent_body(case, response)
    if not isinstance(body, dict):
        return None  # not JSON, or not an object: no field to name
    param = error["param"]
    fields = {field.alias or name for name, field in model_class.model_fields.items()}
    if param is None:
        return f"{status} without param: {error['message']:.200}"
    if str(param).split(".")[0] not in fields and param not in body:  # (an unknown field's name is the body's)
        return f"{status} with param {param!r}, not a field of {model_class.__name__}: {error['message']:.200}"
    return None


def _sent_body(case, response):
    """The JSON the server received (a negative case may send a body that is not JSON)."""
    try:
        return json.loads(response.request.body or b"")
    except (ValueError, TypeError):
        return None


def signature(case, problem: str) -> str:
    """What makes two problems the same one: the route and the problem's first words."""
    return f"{case.method.upper()} {case.operation.path} {' '.join(problem.split()[:6])}"


def as_sent(case, response=None) -> str:
    """The request as the server got it, to send again: ``POST /path {json}`` (a path's own values filled in)."""
    if response is not None:
        body = response.request.body or b""
        body = body.decode("utf-8", "backslashreplace") if isinstance(body, bytes) else str(body)
        return f"{response.request.method} {response.request.path_url} {body[:3000]}"
    return f"{case.method.upper()} {case.formatted_path} {json.dumps(case.body, default=repr)[:3000]}"


class _TimeUp(BaseException):
    """Ends hypothesis' run at the deadline (an Exception would be a failure it reports)."""


def fuzz(url: str, app, model_name: str, seconds: float, max_examples: int,
         seed: int | None = None) -> tuple[collections.Counter, dict[str, tuple[str, str]]]:
    """Send ``request_cases`` to ``url`` until ``max_examples`` or ``seconds`` have passed.

    ``seed``: hypothesis' seed; None: derandomized (the same cases every run, as CI wants).
    Returns (the statuses counted, "none" for no answer; {:func:`signature`: (the problem, the
    request that showed it, :func:`as_sent`)}), each distinct problem once: the run goes on past one.
    """
    statuses, problems, deadline = collections.Counter(), {}, time.monotonic() + seconds

    @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
              derandomize=seed is None, suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @given(case=request_cases(openapi_schema(app), model_name))
    def one(case):
        if time.monotonic() > deadline:
            raise _TimeUp()
        response = None
        try:
            response = case.call(base_url=url, timeout=60)
        except Exception as error:  # noqa: BLE001  (a hung or dropped connection is a finding)
            problem, status = f"no answer: {type(error).__name__}: {error}", "none"
        else:
            problem, status = what_is_wrong(case, response), response.status_code
        statuses[status] += 1
        if problem is not None:
            problems.setdefault(signature(case, problem), (problem, as_sent(case, response)))

    if seed is not None:
        one._hypothesis_internal_use_seed = seed  # what hypothesis' @seed(seed) sets
    try:
        one()
    except _TimeUp:
        pass
    return statuses, problems


class QuietStream:
    """One greedy chat stream sent again and again in a thread, each run's tokens checked
    against the same request's tokens on the quiet server (``reference``).

        stream = QuietStream(url)        # runs it once now: the reference
        stream.start(); ...; stream.stop()
        stream.runs, stream.mismatches   # how many ran through the fuzzing; those that differed
    """

    def __init__(self, url: str, max_tokens: int = 128):
        self.url, self.runs, self.mismatches = url, 0, []
        self.body = {"messages": [{"role": "user", "content": "Tell me about the sea, in detail."}],
                     "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                     "logprobs": True}
        self.reference = self.tokens()
        self._done, self._thread = threading.Event(), threading.Thread(target=self._loop, name="quiet-stream")

    def tokens(self) -> list[tuple[str, tuple[int, ...]]]:
        """The stream's tokens (each token's text and bytes, from its logprobs), in order."""
        tokens = []
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=self.body, timeout=120) as r:
            assert r.status_code == 200, r.read()[:300]
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    assert "error" not in chunk, chunk
                    for choice in chunk["choices"]:
                        tokens += [(t["token"], tuple(t["bytes"])) for t in (choice["logprobs"] or {}).get("content", [])]
        return tokens

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Wait for the run under way to finish, then stop."""
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.is_set():
            try:
                tokens = self.tokens()
            except Exception as error:  # noqa: BLE001  (a broken stream is what this looks for)
                self.mismatches.append(f"the stream failed: {type(error).__name__}: {error}")
                return
            self.runs += 1
            if tokens != self.reference:
                at = next((i for i, (a, b) in enumerate(zip(tokens, self.reference)) if a != b), len(tokens))
                self.mismatches.append(f"run {self.runs}: {len(tokens)} tokens, first differs at token {at}")
