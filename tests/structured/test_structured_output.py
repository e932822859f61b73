"""Structured output (minillm/structured/, llguidance): answers that parse and validate against their
JSON schema, match their regex, or are one of their choices, on the real model and through the
server; OpenAI's response_format and logit_bias, vLLM's structured_outputs and guided_* fields;
constraints that cannot work refused when they are built (a 400), before they meet a batch."""

import json
import re
import subprocess
import sys
import textwrap
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from live_server import live_server

import minillm
from minillm import LLMEngine, SamplingParams

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from minillm.structured import Grammar, grammar_from_request  # noqa: E402
from minillm.structured.grammar import INITIAL_LEXER_FUEL, MAX_GRAMMAR_BYTES  # noqa: E402

TIMEOUT_S = 120.0
# closes in a dozen tokens whatever the model prefers: an enum and a one-digit integer
VERDICT = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                            "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["answer", "confidence"], "additionalProperties": False}
COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
          "additionalProperties": False}
# A million forced 'a's: compiles in a millisecond, then exhausts the lexer's fuel (issue 40's review)
HOSTILE = {"json_schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}, "regex": "(a{1000}){1000}",
           "lark": "start: /(a{1000}){1000}/"}
FUEL_LIMIT = f"exceeds the lexer fuel limit (initial_lexer_fuel {INITIAL_LEXER_FUEL:,}"
YES_NO_GBNF = 'root ::= "yes" | "no"'
JSON_WHITESPACE_BOUND = 20  # the README's bound: at most 20 whitespace characters between two JSON tokens


def chat_ids(tokenizer, question):
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.large
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


@pytest.mark.large
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
    assert build(response_format={"type": "json_object", "schema": COLOUR}).source == COLOUR  # Together's form
    assert build(structured_outputs={"json": COLOUR, "whitespace_pattern": "[ ]?"}).source == COLOUR
    assert build(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": COLOUR}}).source == COLOUR
    assert build(structured_outputs={"choice": ["a", "b"], "disable_fallback": True}).kind == "choice"
    assert build(structured_outputs={"grammar": 'start: "x" | "y"'}).kind == "lark"
    assert build(guided_regex="[0-9]+").kind == "regex"
    with pytest.raises(ValueError, match="give one structured output constraint, got 2"):
        build(guided_regex="a", structured_outputs={"json": COLOUR})
    with pytest.raises(ValueError, match="structured_outputs.regex: cannot compile the regex"):
        build(structured_outputs={"regex": "("})


def constraint(kind, source, tokenizer):
    return getattr(Grammar, kind)(source, tokenizer, vocab_size=49152, eos_token_ids=[2])


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_constraint_over_a_limit_is_refused_when_built(tiny_chat, kind):
    _, tokenizer = tiny_chat
    with pytest.raises(ValueError, match=re.escape(FUEL_LIMIT)) as refused:
        constraint(kind, HOSTILE[kind], tokenizer)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("kind, source, message", [
    ("regex", r"[^\s\S]", "no text matches the regex"),  # a class with no character in it
    ("lark", r'start: "a" /[^\s\S]/', "no text matches the grammar"),
    ("json_schema", {"type": "string", "minLength": 5, "maxLength": 2}, "Unsatisfiable schema"),
    ("lark", "start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_BYTES // 6)), "too large"),
    ("lark", "root ::= item\nitem ::= missing", "cannot convert the GBNF grammar to Lark: Rule 'missing' not found"),
])
def test_what_cannot_work_is_refused_when_built(tiny_chat, kind, source, message):
    _, tokenizer = tiny_chat
    with pytest.raises(ValueError, match=re.escape(message)):
        constraint(kind, source, tokenizer)


def test_a_grammar_that_matches_only_the_empty_text_is_not_refused(tiny_chat):
    _, tokenizer = tiny_chat
    allowed = constraint("regex", "a{0}", tokenizer).matcher().allowed()
    assert allowed.nonzero().flatten().tolist() == [2]  # EOS only: the answer is ""


def test_a_limit_reached_mid_stream_is_a_one_line_value_error(tiny_chat):
    # Two choices first: the forced million 'a's come only at the third token, after admission's two steps
    _, tokenizer = tiny_chat
    grammar = constraint("lark", "start: /[xy][xy]/ /(a{1000}){1000}/", tokenizer)
    matcher = grammar.matcher()
    x, y = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "xy")
    with pytest.raises(ValueError, match=re.escape(FUEL_LIMIT) + r".* after 2 tokens: ") as failed:
        for token in (x, y, None, None):
            allowed = matcher.allowed()
            matcher.accept(token if token is not None else int(allowed.nonzero()[0]))
    assert "\n" not in str(failed.value)
    assert grammar.matcher().allowed()[x]  # the next sequence starts afresh: its own matcher


@pytest.mark.cli
def test_deeply_nested_grammars_compile_on_a_large_stack_without_killing_the_process(smollm2_dir):
    # A chain of 3,000 rules (or 2,000 schema $refs) overflowed an 8 MB stack inside llguidance: SIGSEGV.
    # In a child process, from a thread of the default stack (as the server's), so a regression fails here.
    code = textwrap.dedent("""
        import threading, minillm
        from minillm.structured import Grammar
        tok = minillm.load_tokenizer("smollm2-135m-instruct")
        lark = "start: r0\\n" + "".join(f'r{i}: "x" r{i + 1}\\n' for i in range(3000)) + 'r3000: "z"\\n'
        defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(2000)}
        schema = {"$ref": "#/$defs/d0", "$defs": {**defs, "d2000": {"type": "integer"}}}
        def run():
            print(Grammar.lark(lark, tok).kind, Grammar.json_schema(schema, tok).kind)
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["lark", "json_schema"], (r.returncode, r.stderr[-2000:])


@pytest.fixture(scope="module")
def server(tiny_chat):
    model, tokenizer = tiny_chat
    with live_server(model, tokenizer, num_blocks=128) as url:
        yield url


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


@pytest.mark.server
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


@pytest.mark.server
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


@pytest.mark.server
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


@pytest.mark.server
@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema is missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "cannot compile the json schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ({"guided_regex": "(", "response_format": {"type": "json_object"}}, "guided_regex", "give one structured output"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "not supported by minillm"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unknown field"),
    ({"logit_bias": {"hello": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "logit_bias names token 999999"),
    # refused at admission, before the request meets a batch (issue 40)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": HOSTILE["json_schema"]}}},
     "response_format", FUEL_LIMIT),
    ({"guided_regex": HOSTILE["regex"]}, "guided_regex", FUEL_LIMIT),
    ({"structured_outputs": {"grammar": HOSTILE["lark"]}}, "structured_outputs", FUEL_LIMIT),
    ({"guided_grammar": HOSTILE["lark"]}, "guided_grammar", FUEL_LIMIT),
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "no text matches the regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "Rule 'missing' not found"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " *"}}, "structured_outputs",
     "whitespace_pattern applies to JSON output"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs",
     "whitespace_pattern applies to JSON output"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": "(("}}, "structured_outputs",
     "whitespace_pattern '((' is not a regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"whitespace_pattern": " ?",
                                                                          "disable_any_whitespace": True}},
     "structured_outputs", "give whitespace_pattern or disable_any_whitespace, not both"),
    ({"response_format": {"type": "text", "schema": COLOUR}}, "response_format", "schema goes with type 'json_object'"),
])
def test_bad_structured_requests_are_400s(server, body, param, fragment):
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body},
                   timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error


@pytest.mark.server
@pytest.mark.parametrize("field", [{"guided_grammar": YES_NO_GBNF}, {"structured_outputs": {"grammar": YES_NO_GBNF}}])
def test_a_gbnf_grammar_through_the_server(server, field):
    for seed in range(3):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "Is water wet?", "max_tokens": 5,
                                                         "temperature": 1.0, "seed": seed, **field}, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop", choice


@pytest.mark.server
@pytest.mark.parametrize("whitespace, bound", [
    ({}, JSON_WHITESPACE_BOUND),  # the default: bounded
    ({"whitespace_pattern": "[\\n]{0,3}"}, 3),  # vLLM's knob, honoured
    ({"disable_any_whitespace": True}, 0),
])
def test_json_whitespace_is_bounded_when_the_model_favours_newlines(server, tiny_chat, whitespace, bound):
    _, tokenizer = tiny_chat
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    r = httpx.post(f"{server}/v1/completions", json={
        "prompt": "The verdict:", "max_tokens": 60, "temperature": 0, "logit_bias": {str(newline): 100},
        "structured_outputs": {"json": VERDICT, **whitespace}}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    runs = [len(run) for run in re.findall(r"[ \t\r\n]+", choice["text"])]  # VERDICT has no free-text strings
    assert max(runs, default=0) == bound, (runs, choice)  # the bias takes every newline the grammar allows
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["text"]), VERDICT)
    else:
        assert choice["finish_reason"] == "length" and bound > 0, choice


@pytest.mark.server
def test_instructor_json_schema_mode_json_object_with_a_schema(client):
    # instructor <= 1.3's Mode.JSON_SCHEMA (Together, Anyscale) sends the model's schema next to "json_object"
    class Colour(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        colour: Literal["red", "green", "blue"]

    for seed in range(3):
        reply = client.chat.completions.create(
            model="minillm-test", messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=120,
            temperature=1.0, seed=seed, response_format={"type": "json_object", "schema": Colour.model_json_schema()})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content  # 4 gaps of <= 20 whitespace: it must end
        Colour.model_validate_json(choice.message.content)


def test_vllms_older_whitespace_and_backend_fields_are_accepted(tiny_chat):
    """guided_whitespace_pattern is structured_outputs.whitespace_pattern's older spelling; guided_decoding_backend
    changes nothing here (one backend) and is logged as ignored, as vLLM's clients still send both."""
    from minillm.serving.server.protocol import ChatCompletionRequest

    _, tokenizer = tiny_chat
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "guided_json": COLOUR, "guided_whitespace_pattern": "[ ]{0,2}",
                                                 "guided_decoding_backend": "xgrammar"})
    assert body.structured_fields()["structured_outputs"] == {"whitespace_pattern": "[ ]{0,2}"}
    assert body.ignored_fields() == ["guided_decoding_backend"]
    older = grammar_from_request(tokenizer, 49152, [2], **body.structured_fields())
    newer = grammar_from_request(tokenizer, 49152, [2], guided_json=COLOUR,
                                 structured_outputs={"whitespace_pattern": "[ ]{0,2}"})
    assert older._grammar == newer._grammar
