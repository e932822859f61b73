"""What the CLI writes where, run as a user runs it: the answer or JSON alone on stdout, the rest on stderr."""

import io
import json
import re
import subprocess
import sys

import pytest

from minillm.cli import main
from minillm.cli.generate import _read_prompt

QUESTION = "What is the capital of France?"
REPEATED = "Explain in one sentence why the sky is blue and why the sunsets look red."


def minillm(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True,
                          input=stdin, timeout=900)


def chat_ids(folder, messages) -> list[int]:
    """The oracle: transformers' rendering of the chat template, tokenized."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def json_run(smollm2_dir):
    """Two requests with the same prompt, an empty system message, the prefix cache, no warm-up."""
    return minillm("generate", "--json", "--max-new-tokens", "4", "--prefix-cache", "--system", "",
                   REPEATED, REPEATED)


@pytest.mark.cli
def test_json_is_one_object_per_prompt_and_nothing_else_on_stdout(json_run, smollm2_dir):
    assert json_run.returncode == 0, json_run.stderr
    first, second = [json.loads(line) for line in json_run.stdout.splitlines()]
    assert first["prompt"] == second["prompt"] == REPEATED
    assert first["text"] == second["text"] and first["finish_reason"] == "length"  # greedy, with or without cache
    n_prompt = len(chat_ids(smollm2_dir, [{"role": "system", "content": ""}, {"role": "user", "content": REPEATED}]))
    assert first["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 4, "cached_tokens": 0}
    cached = second["usage"]["cached_tokens"]
    assert 0 < cached < n_prompt and cached % 16 == 0  # the prompt's full blocks of 16


@pytest.mark.cli
def test_an_empty_system_message_is_sent_not_dropped(json_run, smollm2_dir):
    n_prompt = json.loads(json_run.stdout.splitlines()[0])["usage"]["prompt_tokens"]
    without = chat_ids(smollm2_dir, [{"role": "user", "content": REPEATED}])  # SmolLM2's default persona added
    assert n_prompt < len(without)


@pytest.mark.cli
def test_json_metrics_follow_their_definitions(json_run):
    for record in map(json.loads, json_run.stdout.splitlines()):
        m, n = record["metrics"], record["usage"]["completion_tokens"]
        assert m["e2e_ms"] == pytest.approx(m["ttft_ms"] + m["tpot_ms"] * (n - 1))
        assert m["decode_tok_s"] == pytest.approx(1e3 / m["tpot_ms"])
        assert m["output_tok_s"] == pytest.approx(n / m["e2e_ms"] * 1e3)
    assert [json.loads(line)["metrics"]["cold"] for line in json_run.stdout.splitlines()] == [True, False]


@pytest.mark.cli
def test_summary_lines_name_their_rates_and_the_cold_start(json_run):
    records = [json.loads(line) for line in json_run.stdout.splitlines()]
    summaries = [line for line in json_run.stderr.splitlines() if line.startswith("[prompt")]
    assert len(summaries) == 2 and "(cold)" in summaries[0] and "(cold)" not in summaries[1]
    for line, record in zip(summaries, records):
        decode = float(re.search(r"\| decode ([\d.]+) tok/s", line).group(1))
        output = float(re.search(r"\| output ([\d.]+) tok/s", line).group(1))
        assert decode == pytest.approx(1e3 / record["metrics"]["tpot_ms"], abs=0.051)
        assert output == pytest.approx(record["metrics"]["output_tok_s"], abs=0.051)


@pytest.mark.cli
def test_piped_prompt_loses_its_newline_and_trace_stays_off_stdout(smollm2_dir):
    r = minillm("generate", "--json", "--trace", "--max-new-tokens", "12", stdin=f"{QUESTION}\n")
    assert r.returncode == 0, r.stderr
    (record,) = [json.loads(line) for line in r.stdout.splitlines()]  # the panels went to stderr
    assert record["usage"]["prompt_tokens"] == len(chat_ids(smollm2_dir, [{"role": "user", "content": QUESTION}]))
    assert "Paris" in record["text"] and record["metrics"]["cold"] is False  # a trace warms up first
    assert "╭─ Prefill" in r.stderr


@pytest.mark.parametrize("piped, prompt", [("a\n", "a"), ("a\n\n", "a\n"), ("a\r\n", "a"), ("a", "a")])
def test_one_trailing_newline_is_stripped_from_stdin(piped, prompt, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(piped))
    assert _read_prompt("-") == prompt


@pytest.mark.cli
def test_a_closed_pipe_ends_quietly(smollm2_dir):
    """`minillm generate ... | head -c 1`: no "Broken pipe", no traceback, SIGPIPE's status 141."""
    p = subprocess.Popen([sys.executable, "-m", "minillm", "generate", "--no-chat", "--max-new-tokens", "30",
                          "1, 2, 3, 4, 5,"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(1)
    p.stdout.close()  # the reader goes away; the next token's write fails
    err = p.stderr.read().decode()
    assert p.wait(timeout=900) == 141, err
    assert err == ""


def test_prefix_demo_with_one_request_says_n_a(smollm2_dir, capsys):
    assert main(["prefix-demo", "--model", str(smollm2_dir), "--requests", "1", "--max-new-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "warm requests: n/a (none: the first request fills the cache" in out and "nan" not in out


def test_block_size_without_the_prefix_cache_is_named(capsys):
    assert main(["generate", "", "--block-size", "32"]) == 2  # the empty prompt stops it before the model loads
    assert capsys.readouterr().err.startswith("minillm: warning: --block-size has no effect without --prefix-cache\n")
