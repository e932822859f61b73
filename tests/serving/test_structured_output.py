"""Structured output (minillm/structured/, llguidance): answers that parse and validate against their
JSON schema, match their regex, or are one of their choices, on the real model and through the
server; OpenAI's response_format and logit_bias, vLLM's structured_outputs and guided_* fields."""

import json

import httpx
import openai
import pytest
from live_server import live_server

import minillm
from minillm import LLMEngine, SamplingParams

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from minillm.structured import Grammar, grammar_from_request  # noqa: E402

TIMEOUT_S = 120.0
# closes in a dozen tokens whatever the model prefers: an enum and a one-digit integer
VERDICT = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                            "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["answer", "confidence"], "additionalProperties": False}
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
          "additionalProperties": False}


def chat_ids(tokenizer, question):
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_special_tokens=False)


def test_real_model_answers_parse_and_validate(smollm2):
    model, tokenizer = smollm2
    eos = sorted(LLMEngine(model, tokenizer, num_blocks=4).eos_token_ids)
    verdict = Grammar.json_schema(VERDICT, tokenizer, vocab_size=model.config.vocab_size, eos_token_ids=eos)
    questions = ["Is the sky green? Answer in JSON.", "Is 7 a prime number?", "Do fish fly? Reply as JSON."]
    runs = [(q, SamplingParams(max_new_tokens=40, allowed_tokens=verdict)) for q in questions]  # greedy
    runs += [(q, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=40, allowed_tokens=verdict))
             for q in questions[:1] for seed in (1, 2)]
    engine = LLMEngine(model, tokenizer, num_blocks=64)
    outs = engine.generate([chat_ids(tokenizer, q) for q, _ in runs], [p for _, p in runs])
    for (question, _), out in zip(runs, outs):
        assert out.finish_reason == "eos", (question, out.text)
        jsonschema.validate(json.loads(out.text), VERDICT)
        print(f"{question!r}: {out.text!r} ({len(out.token_ids)} tokens)")


def test_real_model_choice_and_regex_with_generate(smollm2):
    model, tokenizer = smollm2
    eos = tokenizer.eos_token_ids
    choice = Grammar.choice(["Paris", "Lyon", "Rome"], tokenizer, vocab_size=model.config.vocab_size, eos_token_ids=eos)
    steps = list(minillm.generate(model, chat_ids(tokenizer, "What is the capital of France?"),
                                  SamplingParams(max_new_tokens=5, allowed_tokens=choice), tokenizer=tokenizer))
    assert "".join(s.text for s in steps) in ("Paris", "Lyon", "Rome") and steps[-1].finish_reason == "eos"
    year = Grammar.regex("1[0-9]{3}", tokenizer, vocab_size=model.config.vocab_size, eos_token_ids=eos)
    steps = list(minillm.generate(model, chat_ids(tokenizer, "In which year did World War I begin?"),
                                  SamplingParams(max_new_tokens=6, allowed_tokens=year), tokenizer=tokenizer))
    text = "".join(s.text for s in steps)
    assert len(text) == 4 and text.startswith("1") and text.isdigit()


def test_request_fields_pick_one_constraint(tiny_chat):
    _, tokenizer = tiny_chat
    build = lambda **fields: grammar_from_request(tokenizer, 49152, [2], **fields)  # noqa: E731
    assert build() is None and build(response_format={"type": "text"}) is None
    assert build(response_format={"type": "json_object"}).source == {"type": "object"}
    assert build(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": COLOUR}}).source == COLOUR
    assert build(structured_outputs={"choice": ["a", "b"], "disable_fallback": True}).kind == "choice"
    assert build(structured_outputs={"grammar": 'start: "x" | "y"'}).kind == "lark"
    assert build(guided_regex="[0-9]+").kind == "regex"
    with pytest.raises(ValueError, match="give one structured output constraint, got 2"):
        build(guided_regex="a", structured_outputs={"json": COLOUR})
    with pytest.raises(ValueError, match="structured_outputs.regex: cannot compile the regex"):
        build(structured_outputs={"regex": "("})


@pytest.fixture(scope="module")
def server(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=128) as url:
        yield url


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


def test_response_format_json_schema_through_the_openai_client(client):
    # The random model would wander in JSON's optional whitespace (allowed by default, as vLLM's):
    # vLLM's disable_any_whitespace keeps its answers to the compact form.
    for seed in range(3):
        reply = client.chat.completions.create(
            model="minillm-test", messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=40,
            temperature=1.0, seed=seed, extra_body={"structured_outputs": {"disable_any_whitespace": True}},
            response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), COLOUR)


def test_vllm_fields_on_completions(server, tiny_chat):
    _, tokenizer = tiny_chat

    def complete(**body):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "The answer:", "max_tokens": 12, **body},
                       timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    for seed in range(3):
        assert complete(structured_outputs={"choice": ["alpha", "beta gamma"]}, temperature=1.0,
                        seed=seed)["text"] in ("alpha", "beta gamma")
    assert complete(guided_choice=["up", "down"])["text"] in ("up", "down")
    text = complete(guided_regex="[a-c]{2}-[0-9]")["text"]
    assert len(text) == 4 and text[:2] in {a + b for a in "abc" for b in "abc"} and text[2] == "-" and text[3].isdigit()
    obj = complete(structured_outputs={"json": COLOUR, "disable_any_whitespace": True}, max_tokens=20)
    jsonschema.validate(json.loads(obj["text"]), COLOUR)


def test_logit_bias_over_http_bans_and_forces(server, tiny_chat):
    _, tokenizer = tiny_chat
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    plain = httpx.post(f"{server}/v1/completions", json=body, timeout=TIMEOUT_S).json()["choices"][0]["text"]
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = httpx.post(f"{server}/v1/completions", json={**body, "logit_bias": {str(first): -100}},
                        timeout=TIMEOUT_S).json()["choices"][0]["text"]
    assert tokenizer.encode(banned, add_special_tokens=False)[0] != first
    forced_id = tokenizer.encode(" dragon", add_special_tokens=False)[0]
    forced = httpx.post(f"{server}/v1/completions", json={**body, "logit_bias": {str(forced_id): 100},
                                                          "temperature": 1.0, "seed": 3}, timeout=TIMEOUT_S)
    assert forced.json()["choices"][0]["text"] == tokenizer.decode([forced_id] * 4)


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema is missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "cannot compile the json schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ({"guided_regex": "(", "response_format": {"type": "json_object"}}, None, "give one structured output"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "not supported by minillm"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unknown field"),
    ({"logit_bias": {"hello": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "logit_bias names token 999999"),
])
def test_bad_structured_requests_are_400s(server, body, param, fragment):
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error
