"""The CLI's options, errors and warnings that need no model run: help, version, spellings, checks."""

import argparse
import importlib.metadata
import os

import pytest

import minillm
from minillm.cli import build_parser, main
from minillm.sweep import DEFAULT_PROMPT_LENGTHS


def _subparsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices.items()


def _options(parser):
    """(option action, the title of its help group) for every option of ``parser``."""
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield action, group.title or ""


@pytest.mark.parametrize("name, parser", _subparsers(), ids=[name for name, _ in _subparsers()])
def test_every_option_has_help_that_states_its_default(name, parser):
    formatter = parser._get_formatter()
    for action, group_title in _options(parser):
        text = formatter._get_help_string(action) if action.help else ""
        assert text, f"{name} {action.option_strings[0]} has no help text"
        on_off_flag = action.nargs == 0  # --chat, --quick: off unless given
        assert on_off_flag or action.required or "default" in (text + group_title).lower(), \
            f"{name} {action.option_strings[0]}: the help does not say the default: {text!r}"


def test_help_appends_the_default_once():
    text = build_parser()._subparsers._group_actions[0].choices["sweep"].format_help()
    assert "prefills per prompt length (median) (default: 3)" in text
    lengths = " ".join(map(str, DEFAULT_PROMPT_LENGTHS))
    assert f"prefill cases (tokens) (default: {lengths})" in " ".join(text.split())  # a list, as typed


def test_version_matches_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"minillm {importlib.metadata.version('minillm')}\n"
    assert minillm.__version__ == importlib.metadata.version("minillm")


def test_an_unexpected_exception_is_one_line_naming_it_and_debug(monkeypatch, capsys):
    import minillm.whatif

    def broken(*args, **kwargs):
        raise RuntimeError("boom\n  in the middle")

    monkeypatch.setattr(minillm.whatif, "predict", broken)
    assert main(["whatif", "--model", "llama-3-8b"]) == 1
    assert capsys.readouterr().err == ("minillm: error: RuntimeError: boom in the middle "
                                       "(run with --debug for the traceback)\n")
    with pytest.raises(RuntimeError, match="boom"):
        main(["whatif", "--model", "llama-3-8b", "--debug"])


def test_whatif_warns_when_the_request_does_not_fit_the_context(capsys):
    assert main(["whatif", "--config", "llama-3-8b", "--prompt-tokens", "20000"]) == 0
    err = capsys.readouterr().err
    # Llama-3-8B: max_position_embeddings 8192 in its config.json
    assert err == ("minillm: warning: 20,000 prompt + 200 output tokens exceed llama-3-8b's 8,192-token "
                   "context: the model cannot run this request; the floors are extrapolated\n")
    assert main(["whatif", "--config", "llama-3-8b", "--prompt-tokens", "7992"]) == 0  # 7992 + 200 = 8192 fits
    assert capsys.readouterr().err == ""


def test_whatif_says_device_is_ignored_with_a_datasheet(capsys):
    assert main(["whatif", "--model", "llama-3-8b", "--device", "cuda"]) == 0
    assert "--device has no effect with --hardware h100" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["info", "download"])
def test_two_different_models_are_a_usage_error(command, capsys):
    assert main([command, "gpt2", "--model", "smollm2-135m-instruct"]) == 2
    assert "two models given: gpt2 and --model smollm2-135m-instruct" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--no-chat", "--system", "Be brief."],
         "--system needs chat mode: drop --no-chat, or put the text in the prompt"),
        (["generate", "hi", "--no-chat", "--no-enable-thinking"],
         "--enable-thinking/--no-enable-thinking is a chat template variable: drop --no-chat"),
        (["generate", "hi", "--plots", "{file}"], "--plots: {file} exists and is not a folder"),
        (["generate", "hi", "--trace-out", "/proc/self/trace.jsonl"], "cannot write in /proc/"),
        (["bench", "--json", "/proc/self/bench.json"], "cannot write in /proc/"),
        (["prefix-demo", "--plot", "/proc/self/p.png"], "cannot write in /proc/"),
    ],
)
def test_bad_outputs_and_contradicting_flags_are_usage_errors_before_the_work(args, message, tmp_path, capsys):
    taken = tmp_path / "taken.png"
    taken.write_text("keep me")
    assert main([a.format(file=taken) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(file=taken) in err
    assert taken.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_output_file_is_refused(tmp_path, capsys):
    out = tmp_path / "trace.jsonl"
    out.write_text("")
    out.chmod(0o444)
    assert main(["generate", "hi", "--trace-out", str(out)]) == 2
    assert "is read-only" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench-serving", "--tp", "3"], ["whatif", "--model", "llama-3-8b", "--prompt", "10"]])
def test_an_abbreviated_option_is_refused_not_read_as_a_longer_one(argv, capsys):
    """`bench-serving --tp 3` once ran as --tpot-slo-ms 3: argparse's prefix matching is off."""
    assert main(argv) == 2
    assert f"unrecognized arguments: {' '.join(argv[-2:])}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, trace, prompts", [
    (["--trace", "Hello"], "steps", ["Hello"]),               # was "invalid choice: 'Hello'"
    (["--trace", "layers", "Hello"], "layers", ["Hello"]),
    (["A", "--trace", "B"], "steps", ["A", "B"]),
    (["--trace", "A", "B"], "steps", ["A", "B"]),
    (["Hi", "--trace"], "steps", ["Hi"]),
    (["--trace=layers", "X"], "layers", ["X"]),
])
def test_a_prompt_right_after_trace_is_a_prompt_not_a_level(argv, trace, prompts, monkeypatch):
    """`minillm generate --trace "Hello"`: the word after --trace is its level only when it is one."""
    import minillm.cli.generate as generate
    seen = {}
    monkeypatch.setattr(generate, "_run_generate", lambda args: seen.update(trace=args.trace, prompt=args.prompt))
    args = build_parser().parse_args(["generate", *argv])
    args.run(args)
    assert seen == {"trace": trace, "prompt": prompts}
