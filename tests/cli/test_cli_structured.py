"""`minillm generate --json-schema/--regex/--choice/--logit-bias`, run as a user runs it; the usage errors
in this process."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
          "additionalProperties": False}


def minillm(*args):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def default_model(smollm2_dir):
    return smollm2_dir


@pytest.mark.cli
def test_json_schema_answer_validates_and_the_trace_counts_allowed_tokens(tmp_path):
    schema = tmp_path / "colour.json"
    schema.write_text(json.dumps(SCHEMA))
    trace = tmp_path / "trace.jsonl"
    r = minillm("generate", "What colour is grass? Answer in JSON.", "--json-schema", str(schema),
                "--max-new-tokens", "30", "--trace-out", str(trace))
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMA)
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    allowed = [e["allowed_tokens"] for e in events if e["kind"] in ("prefill", "decode") and "next_token_id" in e]
    metrics = next(e for e in events if e["kind"] == "metrics")
    assert len(allowed) == metrics["n_output_tokens"] and metrics["finish_reason"] == "eos"
    assert allowed[0] <= 2 and allowed[-1] >= 1 and all(1 <= n <= 49152 for n in allowed)  # '{' or '{"' first


@pytest.mark.parametrize("args, message", [
    (["--json-schema", "/no/such/schema.json"], "--json-schema: no file /no/such/schema.json"),
    (["--json-schema", "/"], "--json-schema: / is a folder, not a schema file"),
    (["--regex", "a", "--choice", "b"], "not allowed with argument"),
    (["--logit-bias", "4011=-100", "--logit-bias", "4011=100"], "--logit-bias: token 4011 given twice"),
    (["--logit-bias", "999999=5"], "--logit-bias: token 999999 is not in the vocabulary (size 49152"),
    (["--logit-bias", "28"], "--logit-bias takes ID=BIAS (e.g. 28=-100), got '28'"),
    (["--logit-bias", "28=-500"], "logit_bias[28] must be a number in [-100, 100]"),
    (["--choice", "a", "--speculative", "ngram"], "--speculative does not go with --json-schema"),
    (["--regex", "(a{1000}){1000}"], "--regex: the regex exceeds the lexer fuel limit (initial_lexer_fuel"),
    (["--regex", r"[^\s\S]"], "--regex: no text matches the regex"),
])
def test_usage_errors_exit_2(run_main, args, message):
    """In this process (conftest's run_main; tests/cli/test_cli.py runs one usage error as a process): those
    the grammar finds load the default model first, in a second, not a process's start on top."""
    r = run_main("generate", "hi", *args)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
