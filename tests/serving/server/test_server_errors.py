"""Bad requests to minillm serve: each gets its HTTP status and OpenAI's error JSON, one line that
names the field; the server keeps serving. Also the waiting-queue limit (503) and a client that
gives up on a non-streaming request (its request is aborted)."""

import json
import socket
import threading

import httpx
import openai
import pytest
from live_server import app_of, live_server, wait_until

import minillm
from minillm.serving.server import admission

TIMEOUT_S = 60.0
CONTEXT = 512  # tiny_chat's max_position_embeddings
USER = [{"role": "user", "content": "Hi"}]

# (endpoint under /v1, or a path from /; body: dict -> JSON, str/bytes -> sent as is; status, param, a piece
# of the message)
CASES = {
    "bad JSON": ("completions", '{"prompt": "hi",', 400, None, "not valid JSON"),
    "non-UTF-8 body": ("completions", b'{"prompt": "caf\xe9"}', 400, None, "not UTF-8"),
    "empty body": ("completions", "", 400, None, "not valid JSON"),
    "body is a list": ("completions", "[1, 2]", 400, None, "object"),
    "prompt missing": ("completions", {"max_tokens": 3}, 400, "prompt", "required"),
    "prompt empty string": ("completions", {"prompt": ""}, 400, "prompt", "empty"),
    "prompt empty ids": ("completions", {"prompt": []}, 400, "prompt", "empty"),
    "prompt is a number": ("completions", {"prompt": 42}, 400, "prompt", "string"),
    "batch of prompts": ("completions", {"prompt": [[1, 2], [3]]}, 400, "prompt", "one prompt per request"),
    "prompt list of strings": ("completions", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    "prompt mixes ids and text": ("completions", {"prompt": [1, "a"]}, 400, "prompt", "item 1 is 'a'"),
    "token id outside the vocabulary": ("completions", {"prompt": [1, 49152]}, 400, "prompt", "vocabulary"),
    "negative token id": ("completions", {"prompt": [-1, 5]}, 400, "prompt", "vocabulary"),
    "huge prompt": ("completions", {"prompt": [7] * (CONTEXT + 100)}, 400, "prompt", f"{CONTEXT} tokens"),
    "prompt + max_tokens over the context": ("completions", {"prompt": [7] * 500, "max_tokens": 50}, 400,
                                             "max_tokens", f"{CONTEXT} tokens"),
    "max_tokens 0 without echo": ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens",
                                  "max_tokens: 0 generates nothing: it needs echo: true"),
    "negative max_tokens": ("completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens", "-5"),
    "max_tokens as a string": ("completions", {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens", "integer"),
    "max_tokens a float": ("completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens", "integer"),
    "temperature negative": ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "-1"),
    "temperature a word": ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    "top_p 0": ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    "top_k -2": ("completions", {"prompt": "hi", "top_k": -2}, 400, "top_k", "-1"),
    "n 0": ("completions", {"prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    "n 129": ("chat/completions", {"messages": USER, "n": 129}, 400, "n", "less than or equal to 128"),
    "n over max_num_seqs": ("completions", {"prompt": "hi", "n": 33}, 400, "n", "max_num_seqs = 32"),
    "stop string over 1,024 characters": ("completions", {"prompt": "hi", "stop": [" " * 1025]}, 400, "stop",
                                          "at most 1,024 characters"),
    "more messages than the context has tokens": ("chat/completions", {"messages": [{"role": "user", "content": ""}]
                                                  * (CONTEXT + 1)}, 400, "messages", f"{CONTEXT + 1} messages"),
    "tokenize more messages than the context": ("/tokenize", {"messages": [{"role": "user", "content": ""}]
                                                * (CONTEXT + 1)}, 400, "messages", f"{CONTEXT + 1} messages"),
    "n a string": ("completions", {"prompt": "hi", "n": "2"}, 400, "n", "integer"),
    "best_of": ("completions", {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of", "not supported by minillm"),
    "empty stop string": ("completions", {"prompt": "hi", "stop": ""}, 400, "stop", "non-empty"),
    "stop a number": ("completions", {"prompt": "hi", "stop": 5}, 400, "stop", "string"),
    "stop list with a number": ("completions", {"prompt": "hi", "stop": ["a", 1]}, 400, "stop.1", "string"),
    "stream_options without stream": ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
                                      400, "stream_options", "stream: true"),
    "negative seed": ("completions", {"prompt": "hi", "seed": -1}, 400, "seed", "greater than or equal to 0"),
    "stream not a bool": ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    "unknown field": ("completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "unknown field"),
    "unknown model": ("completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model", "minillm-test"),
    "completions logprobs 21": ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs",
                                "less than or equal to 20"),
    "completions logprobs true": ("completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs", "integer"),
    "echo not a bool": ("completions", {"prompt": "hi", "echo": "yes"}, 400, "echo", "boolean"),
    "messages missing": ("chat/completions", {"max_tokens": 3}, 400, "messages", "required"),
    "empty messages": ("chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    "messages not a list": ("chat/completions", {"messages": "Hi"}, 400, "messages", "array"),
    "chat_template_kwargs not an object": ("chat/completions", {"messages": USER, "chat_template_kwargs": "x"}, 400,
                                           "chat_template_kwargs", "object"),
    "chat_template_kwargs sets messages": ("chat/completions", {"messages": USER, "chat_template_kwargs": {
        "messages": "x"}}, 400, "chat_template_kwargs", "may not set messages"),
    "chat_template_kwargs sets add_generation_prompt": ("chat/completions", {"messages": USER, "chat_template_kwargs": {
        "add_generation_prompt": False}}, 400, "chat_template_kwargs", "may not set add_generation_prompt"),
    "unknown role": ("chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, 400,
                     "messages.0.role", "'robot'"),
    "user message without content": ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages",
                                     "content"),
    "image content part": ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x.png"}}]}]}, 400, "messages.0.content.0.type", "'text'"),
    "content a number": ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
                         "messages.0.content", "string"),
    "top_logprobs without logprobs": ("chat/completions", {"messages": USER, "top_logprobs": 2}, 400,
                                      "top_logprobs", "logprobs: true"),
    "top_logprobs 50": ("chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400,
                        "top_logprobs", "20"),
    "chat unknown model": ("chat/completions", {"messages": USER, "model": "nope"}, 404, "model", "does not exist"),
    # fields that would change the answer: "not supported by minillm", not a silently different answer
    "tools": ("chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
              400, "tools", "not supported by minillm"),
    "tool_choice auto": ("chat/completions", {"messages": USER, "tool_choice": "auto"}, 400, "tool_choice",
                         "not supported by minillm"),
    "tool_choice a function": ("chat/completions", {"messages": USER, "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, 400, "tool_choice", "not supported by minillm"),
    # structured output and logit_bias are served (tests/structured/test_structured_output.py); bad ones are 400s
    "response_format an unknown type": ("chat/completions", {"messages": USER, "response_format": {"type": "xml"}},
                                        400, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    "response_format's schema not a schema": ("chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, 400, "response_format",
        "cannot compile the json schema"),
    "guided_regex that does not compile": ("completions", {"prompt": "hi", "guided_regex": "("}, 400, "guided_regex",
                                           "cannot compile the regex"),
    "logit_bias over 100": ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias",
                            "[-100, 100]"),
    "logit_bias outside the vocabulary": ("completions", {"prompt": "hi", "logit_bias": {"49152": 5}}, 400,
                                          "logit_bias", "vocabulary"),
    "logit_bias by token text": ("completions", {"prompt": "hi", "logit_bias": {"hi": 5}}, 400, "logit_bias",
                                 "token ids"),
    "assistant tool_calls the template cannot render": ("chat/completions", {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400,
        "messages.0.tool_calls", "does not render tool calls"),
    "tool call without its function": ("chat/completions", {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}]}, 400,
        "messages.0.tool_calls.0.function", "required"),
    "chat max_completion_tokens 0": ("chat/completions", {"messages": USER, "max_completion_tokens": 0}, 400,
                                     "max_completion_tokens", "greater than or equal to 1"),
    # issue 40: found by hand and by the fuzzer (test_server_fuzz.py); each was a 500 or a 400 with param null
    "logit_bias key a superscript digit": ("completions", {"prompt": "hi", "logit_bias": {"\u00b2": 5}}, 400,
                                           "logit_bias", "token ids"),  # "²".isdigit(), but int("²") fails
    "logit_bias key of 5,000 digits": ("completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 5}}, 400,
                                       "logit_bias", "5,000 digits) is beyond any vocabulary"),
    "logit_bias key past 64 bits": ("completions", {"prompt": "hi", "logit_bias": {"1" + "0" * 19: 5}}, 400,
                                    "logit_bias", "beyond any vocabulary"),
    "logit_bias key past the vocabulary": ("completions", {"prompt": "hi", "logit_bias": {"4294967296": 5}}, 400,
                                           "logit_bias", "not in the vocabulary"),
    "prompt id past 64 bits": ("completions", {"prompt": [1, 10**30]}, 400, "prompt", "item 1 is 1000000"),
    "detokenize id past 32 bits": ("/detokenize", {"tokens": [5, 2**40]}, 400, "tokens", "not in the vocabulary"),
    "repetition_penalty 1e400 (infinite)": ("completions", '{"prompt": "hi", "repetition_penalty": 1e400}', 400,
                                            "repetition_penalty", "finite"),
    "unknown field with a line break": ("completions", {"prompt": "hi", "a\nb": 1}, 400, "a\nb", "a\\nb: unknown"),
    "unknown field named like a union branch": ("completions", {"prompt": "hi", "str": 1}, 400, "str",
                                                "unknown field"),
    "unknown field with an empty name": ("/detokenize", {"tokens": [], "": None}, 400, "", "unknown field"),
    "chat prompt over the context": ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]},
                                     400, "messages", f"{CONTEXT} tokens"),
    # issue 44: vLLM's cache_salt, Anthropic's cache_control
    "cache_salt empty": ("completions", {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt", "non-empty string"),
    "cache_salt a number": ("chat/completions", {"messages": USER, "cache_salt": 7}, 400, "cache_salt", "string"),
    "cache_control an unknown type": ("completions", {"prompt": "hi", "cache_control": {"type": "persistent"}}, 400,
                                      "cache_control.type", "'ephemeral'"),
    "cache_control ttl 2h": ("completions", {"prompt": "hi", "cache_control": {"type": "ephemeral", "ttl": "2h"}},
                             400, "cache_control.ttl", "'5m' or '1h'"),
    "cache_control a string": ("completions", {"prompt": "hi", "cache_control": "ephemeral"}, 400, "cache_control",
                               "an object"),
    "message cache_control ttl 1d": ("chat/completions", {"messages": [dict(USER[0], cache_control={
        "type": "ephemeral", "ttl": "1d"})]}, 400, "messages.0.cache_control.ttl", "'5m' or '1h'"),
    "content part cache_control without type": ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi", "cache_control": {"ttl": "5m"}}]}]}, 400,
        "messages.0.content.0.cache_control.type", "required"),
    "cache_control at the top of a chat": ("chat/completions", {"messages": USER, "cache_control": {
        "type": "ephemeral"}}, 400, "cache_control", "unknown field"),  # Anthropic's goes on a message or a part
}


@pytest.mark.server
def test_unknown_route_and_method_get_openai_errors(server):
    for method, path, status in (("POST", "/v1/embeddings", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, f"{server}{path}", timeout=TIMEOUT_S)
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and path in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def server(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64) as url:
        yield url


@pytest.mark.server
@pytest.mark.parametrize("name", CASES)
def test_bad_request_gets_an_openai_error(server, name):
    endpoint, body, status, param, fragment = CASES[name]
    content = json.dumps(body) if isinstance(body, dict) else body
    url = f"{server}{endpoint}" if endpoint.startswith("/") else f"{server}/v1/{endpoint}"
    r = httpx.post(url, content=content, timeout=TIMEOUT_S, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"] and "\n" not in error["message"]


@pytest.mark.server
@pytest.mark.parametrize("raw", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n",
                                 b"NOT HTTP AT ALL\r\n\r\n",
                                 b"GET /v1/models HTTP/1.1\r\nHost: x\r\nA header without a colon\r\n\r\n"],
                         ids=["bad Content-Length", "no request line", "bad header"])
def test_malformed_http_gets_an_openai_error(server, raw):
    """HTTP that uvicorn cannot parse never reaches the app: its protocol answers (was: text/plain
    'Invalid HTTP request received.', now OpenAI's JSON; app.JSONErrorsHTTPProtocol)."""
    with socket.create_connection(("127.0.0.1", httpx.URL(server).port), timeout=TIMEOUT_S) as connection:
        connection.sendall(raw)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
    assert json.loads(body) == {"error": {"message": "the HTTP request is malformed (the server could not parse its "
                                                     "request line or headers); send HTTP/1.1",
                                          "type": "invalid_request_error", "param": None, "code": None}}


@pytest.mark.server
def test_server_keeps_serving_after_bad_requests(server):
    for body in ('{"prompt": ', {"prompt": [10**9]}, {"prompt": "x", "max_tokens": -1}):
        httpx.post(f"{server}/v1/completions", content=body if isinstance(body, str) else json.dumps(body),
                   timeout=TIMEOUT_S)
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{server}/health", timeout=TIMEOUT_S).status_code == 200
    engine = app_of(server).state.async_engine.engine
    assert not engine.has_unfinished_requests()


@pytest.mark.server
def test_full_waiting_queue_is_503_and_a_client_that_gives_up_aborts(tiny_chat):
    """One request runs (max_num_seqs 1), one waits (the limit, 1): a third gets 503. The
    waiting one's client then gives up: the server aborts it before it ever runs. The test
    holds the engine's lock meanwhile, so the running request cannot finish first."""
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64, max_num_seqs=1, max_waiting_requests=1) as url:
        async_engine = app_of(url).state.async_engine
        engine, lock = async_engine.engine, async_engine.lock
        with lock:  # a long request straight into the engine: it holds the only slot
            hog = engine.add_request([5] * 20, minillm.SamplingParams(max_new_tokens=480, ignore_eos=True))
        async_engine.wake()
        wait_until(lambda: engine.requests[hog].status == "running")
        third = []

        def waiting_client():  # gives up after 1 s, long before its turn
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json={"prompt": [6] * 20, "max_tokens": 4}, timeout=1.0)

        def third_client():
            third.append(httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                    timeout=TIMEOUT_S))

        waiter, late = threading.Thread(target=waiting_client), threading.Thread(target=third_client)
        waiter.start()
        wait_until(lambda: len(engine.scheduler.waiting) == 1)
        with lock:  # the engine stands still: the hog runs, the waiter waits
            late.start()
            wait_until(lambda: len(async_engine._commands) == 1)  # the third one's add, queued first
            waiter.join(TIMEOUT_S)
            wait_until(lambda: len(async_engine._commands) == 2)  # the waiter's abort: the server saw it leave
            (waited,) = [r for r in engine.requests.values() if r.prompt_ids == [6] * 20]
        late.join(TIMEOUT_S)
        assert third[0].status_code == 503
        error = third[0].json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "queue_full")
        assert "--max-waiting-requests" in error["message"]
        wait_until(lambda: waited.finished)
        assert waited.finish_reason == "abort" and waited.output_ids == []
        assert engine.requests[hog].finish_reason is None  # still running: the abort did not wait for it


@pytest.mark.server
def test_a_failing_step_fails_its_requests_and_the_server_goes_on(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64) as url:
        engine = app_of(url).state.async_engine.engine
        real_step = engine.step

        def broken_step():  # one step fails after scheduling (blocks taken), as a device error would
            engine.step = real_step
            engine.scheduler.schedule()
            assert engine.cache.allocator.num_free_blocks < 64
            raise RuntimeError("boom")

        engine.step = broken_step
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=TIMEOUT_S)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "server_error" and "RuntimeError: boom" in error["message"]
        assert engine.cache.allocator.num_free_blocks == 64  # the failed request's blocks came back
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=TIMEOUT_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.server
def test_a_lost_tensor_parallel_rank_makes_the_server_unhealthy(tiny_chat):
    """A step that raises EngineLostError (minillm/distributed/comm.py's TensorParallelError: a rank died) fails
    its request with the rank named; from then on /health answers 503 and new requests are refused."""
    from minillm.distributed.comm import TensorParallelError

    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64) as url:
        engine = app_of(url).state.async_engine.engine
        lost = "rank 0 of 2: the all-reduce of blocks.0.mlp.down_proj failed: rank 1 (pid 123) died (killed by SIGKILL)"

        def lost_step():
            raise TensorParallelError(lost)

        assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200
        engine.step = lost_step
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=TIMEOUT_S)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert lost in r.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=TIMEOUT_S)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert health.json()["error"]["message"] == f"the engine cannot run: {lost}; restart the server"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=TIMEOUT_S)
        assert r.status_code == 503 and r.json()["error"]["message"] == health.json()["error"]["message"]


@pytest.mark.server
def test_api_key_is_required_on_v1_when_set(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=16, api_key="s3cret") as url:
        body = {"prompt": "Hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s3crét".encode("latin-1")}):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT_S)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=TIMEOUT_S) as client:
            assert client.completions.create(model="minillm-test", **body).usage.completion_tokens == 2
        assert httpx.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200  # open: a probe has no key


@pytest.mark.server
def test_a_body_over_the_limit_is_413(server, monkeypatch):
    monkeypatch.setattr(admission, "MAX_BODY_BYTES", 4096)
    body = json.dumps({"prompt": "word " * 2000, "max_tokens": 2})  # 10 KB
    r = httpx.post(f"{server}/v1/completions", content=body, timeout=TIMEOUT_S)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert "over 4,096 bytes" in r.json()["error"]["message"]
    short = httpx.post(f"{server}/v1/completions", json={"prompt": "word", "max_tokens": 2}, timeout=TIMEOUT_S)
    assert short.status_code == 200


@pytest.mark.server
def test_a_pool_smaller_than_the_context_is_the_servers_limit_said_up_front(tiny_chat):
    """11 blocks of 16 hold 176 positions, fewer than the model's 512: a request that could never
    finish in the pool is refused before it runs (it used to end 'length' after a few tokens)."""
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=11) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 11 * 16
        prompt = list(range(100, 250))  # 150 tokens
        too_long = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 100, "ignore_eos": True})
        assert too_long.status_code == 400
        error = too_long.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert "176 tokens" in error["message"] and "250 were requested" in error["message"]
        assert "whichever is less: GET /v1/models), but 250 were requested" in error["message"]  # (one sentence)
        fits = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 26, "ignore_eos": True})
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 26


@pytest.mark.server
def test_a_logit_bias_key_with_thousands_of_leading_zeros_names_its_token(server):
    """"00...01" is token 1 (as int() reads it), not a 400 in Python's words about its digit limit."""
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "logit_bias": {"0" * 4999 + "1": 100}}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    forced = httpx.post(f"{server}/v1/completions", timeout=TIMEOUT_S, json={**body, "logit_bias": {"1": 100}})
    assert r.json()["choices"][0]["text"] == forced.json()["choices"][0]["text"]


@pytest.mark.server
def test_an_n_that_no_wait_can_fit_is_a_400_even_while_the_queue_is_full(tiny_chat):
    """The queue is full (one request waits, the limit is 1): n = 1 hears 503, retry later; n = 2 with
    max_num_seqs 1 would never fit, so it hears 400 naming n, not an invitation to retry."""
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=64, max_num_seqs=1, max_waiting_requests=1) as url:
        async_engine = app_of(url).state.async_engine
        replies = {}

        def send(n):
            replies[n] = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT_S,
                                    json={"prompt": "Hi", "max_tokens": 2, "n": n, "temperature": 1.0})

        with async_engine.lock:  # no step runs: the request added here stays waiting while both adds apply
            async_engine.engine.add_request([5] * 20, minillm.SamplingParams(max_new_tokens=100, ignore_eos=True))
            clients = [threading.Thread(target=send, args=(n,)) for n in (1, 2)]
            for client in clients:
                client.start()
            wait_until(lambda: len(async_engine._commands) == 2)
        for client in clients:
            client.join(TIMEOUT_S)
    assert replies[1].status_code == 503 and replies[1].json()["error"]["code"] == "queue_full"
    assert replies[2].status_code == 400 and replies[2].json()["error"]["param"] == "n"
    assert "max_num_seqs = 1" in replies[2].json()["error"]["message"]
