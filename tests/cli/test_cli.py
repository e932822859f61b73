"""The minillm command line, run as a user runs it: in a subprocess; its usage errors in this process
(main's exit code and stderr, conftest's run_main), one of each command's also in a subprocess."""

import importlib.abc
import json
import os
import shutil
import subprocess
import sys

import pytest
from tiny_models import CONFIGS, build_hf, save_hf

from minillm.cli import main


def minillm(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True,
                          input=stdin, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def default_model(smollm2_dir):
    """Make sure the default model is in the weights dir before the CLI looks for it."""
    return smollm2_dir


@pytest.fixture(scope="module")
def no_template_folder(tmp_path_factory, smollm2_dir):
    """A tiny random GPT-2 with SmolLM2's tokenizer (its vocabulary) but no chat template, as base models ship."""
    pytest.importorskip("transformers")
    family, kwargs = CONFIGS["gpt2"]
    folder = save_hf(build_hf(family, dict(kwargs, vocab_size=49152)), tmp_path_factory.mktemp("no_template"))
    shutil.copy(smollm2_dir / "tokenizer.json", folder / "tokenizer.json")
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.mark.cli
def test_generate_answers_paris():
    r = minillm("generate", "What is the capital of France?", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    summary = r.stderr.strip().splitlines()[-1]
    assert "TTFT" in summary and "TPOT" in summary and "stop: eos" in summary


@pytest.mark.cli
def test_prompt_from_stdin_without_chat():
    r = minillm("generate", "-", "--no-chat", "--max-new-tokens", "3", stdin="The capital of France is")
    assert r.returncode == 0, r.stderr
    assert "generated 3 tok" in r.stderr


USAGE_ERRORS = [
    (["generate", "hi", "--bogus"], "unrecognized arguments: --bogus"),
    (["generate", "hi", "--top-p", "2"], "top-p must be in (0, 1]"),
    (["generate", "hi", "--max-new-tokens", "0"], "max-new-tokens must be an integer >= 1"),
    (["generate", "hi", "--temperature", "abc"], "invalid float value"),
    (["generate", "   "], "the prompt is empty"),
    (["frobnicate"], "invalid choice"),
    (["generate", "hi", "--trace-out", "/"], "is a folder; give a file name"),
    (["generate", "hi", "--trace-out", "/no/such/folder/t.jsonl"], "folder /no/such/folder does not exist"),
]


@pytest.mark.cli
def test_the_command_exits_2_with_one_line_on_a_usage_error():
    """The process path of every usage error below: `python -m minillm`'s exit code is main's return."""
    args, message = USAGE_ERRORS[0]
    r = minillm(*args)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, message", USAGE_ERRORS)
def test_usage_errors_exit_2_with_one_line(run_main, args, message):
    r = run_main(*args)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and message in r.stderr
    assert "Traceback" not in r.stderr


def test_chat_on_a_model_without_a_chat_template_exits_2_with_one_line(run_main, no_template_folder):
    """A usage error, as the README promises (it exited 1 with the tokenizer's "pass a plain prompt instead")."""
    r = run_main("generate", "hi", "--chat", "--model", str(no_template_folder))
    assert (r.returncode, r.stderr, r.stdout) == (
        2, f"minillm: error: --chat needs a chat template and {no_template_folder} has none; drop --chat\n", "")


@pytest.mark.cli
def test_generate_runs_in_float64(no_template_folder):
    """load_model takes float64 (to check that two paths agree to the last bit); --dtype refused it."""
    r = minillm("generate", "hi", "--model", str(no_template_folder), "--dtype", "float64", "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "generated 2 tok" in r.stderr


@pytest.mark.parametrize("where", ["argv", "stdin"])
def test_a_prompt_that_is_not_utf8_exits_1_with_one_line(run_main, where):
    """A Latin-1 byte (0xe9) in the prompt: was "TypeError: TextInputSequence must be str". Python hands the
    command such a byte as a surrogate (U+DCE9): os.fsdecode reads argv so, and a pipe on stdin reads so where
    its error handler is surrogateescape (the C and C.UTF-8 locales)."""
    prompt = b"caf\xe9 au lait"
    if where == "argv":
        r = run_main("generate", "--max-new-tokens", "2", os.fsdecode(prompt))
    else:
        r = run_main("generate", "--max-new-tokens", "2", "-", stdin=prompt.decode("utf-8", "surrogateescape"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "not valid UTF-8: byte 0xe9" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_path_exits_1_with_one_line(run_main, tmp_path):
    r = run_main("generate", "hi", "--model", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "no model at" in r.stderr


@pytest.mark.cli
def test_debug_shows_the_traceback(tmp_path):
    r = minillm("--debug", "generate", "hi", "--model", str(tmp_path / "nope"))
    assert r.returncode == 1 and "Traceback" in r.stderr


@pytest.mark.cli
def test_info_reports_parameters_and_kv_bytes():
    r = minillm("info")
    assert r.returncode == 0, r.stderr
    assert "134,515,008" in r.stdout  # SmolLM2-135M's parameter count (embeddings tied)
    assert "46,080" in r.stdout  # KV bytes per token: 2 * 30 layers * 3 KV heads * 64 * 4 bytes


OUT_FOLDER_COMMANDS = pytest.mark.parametrize(
    "args",
    [
        ["convert", "{gguf}", "{out}"],
        ["sweep", "--out", "{out}", "--prompt-lengths", "4", "--context-lengths", "8", "--repeats", "1",
         "--decode-steps", "1"],
    ],
    ids=["convert", "sweep"],
)


@pytest.mark.cli
@OUT_FOLDER_COMMANDS
def test_output_folder_through_a_file_exits_2_in_the_command(tmp_path, smollm2_gguf, args):
    """The process path of each command's usage error (its cases are below, in this process)."""
    (tmp_path / "taken").write_text("keep me")
    r = minillm(*(a.format(gguf=smollm2_gguf, out=tmp_path / "taken") for a in args))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and f"{tmp_path / 'taken'} exists and is not a folder" in r.stderr


@OUT_FOLDER_COMMANDS
@pytest.mark.parametrize("out", ["taken", "taken/out"])
def test_output_folder_through_a_file_exits_2_before_the_work(run_main, tmp_path, smollm2_gguf, args, out):
    (tmp_path / "taken").write_text("keep me")
    r = run_main(*(a.format(gguf=smollm2_gguf, out=tmp_path / out) for a in args))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and f"{tmp_path / 'taken'} exists and is not a folder" in r.stderr
    assert (tmp_path / "taken").read_text() == "keep me"


class _InterruptImport(importlib.abc.MetaPathFinder):
    """Ctrl-C pressed while ``module`` is being imported."""

    def __init__(self, module: str):
        self.module = module

    def find_spec(self, name, path, target=None):
        if name == self.module:
            raise KeyboardInterrupt
        return None


def test_ctrl_c_during_a_lazy_import_exits_130_with_one_line(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "minillm.whatif", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_InterruptImport("minillm.whatif"), *sys.meta_path])
    assert main(["whatif", "--config", "llama-3-8b"]) == 130
    assert capsys.readouterr().err == "minillm: interrupted\n"
