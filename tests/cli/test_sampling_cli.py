"""The sampling and stopping flags of 'minillm generate' and the generation defaults of
'minillm info', run in a subprocess on the default model as a user runs them; the flags' usage
errors in this process."""

import json
import subprocess
import sys

import pytest


def minillm(*args):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.cli
def test_stop_string_never_printed_tiny_temperature_greedy_and_ignored_flags_warned(smollm2_dir):
    r = minillm("generate", "What is the capital of France?", "--model", str(smollm2_dir), "--stop", " Paris",
                "--temperature", "1e-39", "--top-k", "5", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is\n"  # greedy: "The capital of France is Paris."
    warning, summary = r.stderr.strip().splitlines()[-2:]
    assert warning == ("minillm: warning: --top-k, --seed have no effect: temperature 1e-39 is greedy decoding; "
                       "set --temperature > 0 to sample")
    assert "stop: stop" in summary


@pytest.mark.cli
def test_generation_config_eos_stops_the_cli_and_info_names_its_source(smollm2_dir, tmp_path):
    for f in smollm2_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4649], "num_beams": 1}))
    r = minillm("generate", "What is the capital of France?", "--model", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France\n" and "stop: eos" in r.stderr
    info = minillm("info", str(tmp_path))
    assert info.returncode == 0, info.stderr
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in info.stdout.splitlines() if line.count("│") == 4}
    assert rows["eos_token_ids"] == ["[2, 4649]", "generation_config.json"]
    assert rows["temperature"] == ["0.0", "generation_config.json (greedy)"]
    assert rows["min_p"] == ["0.0", "minillm default"]
    assert rows["not used by minillm"] == ["num_beams", "generation_config.json"]


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--min-p", "3", "--min-p must be in [0, 1] (0 = off), got 3.0"),
        ("--repetition-penalty", "0", "--repetition-penalty must be a finite number > 0 (1 = off), got 0.0"),
        ("--presence-penalty", "2.5", "--presence-penalty must be in [-2, 2] (0 = off), got 2.5"),
        ("--temperature", "nan", "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ],
)
def test_bad_sampling_flags_are_one_line_usage_errors(run_main, flag, value, message):
    """In this process (conftest's run_main): said before the model loads."""
    r = run_main("generate", "hi", flag, value)
    assert r.returncode == 2 and r.stderr == f"minillm: error: {message}\n"
