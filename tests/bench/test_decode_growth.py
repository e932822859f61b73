"""benchmarks/decode_growth.py: llama-bench's JSON read into ms a token (hand-computed), the --gguf argument's
form and its one-line error, and a tiny end-to-end run whose llama-bench is a stand-in script printing known
rows (the minillm points from decode_paths.py's own process, the plot written)."""

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_growth.py"
spec = importlib.util.spec_from_file_location("decode_growth", SCRIPT)
growth = importlib.util.module_from_spec(spec)
spec.loader.exec_module(growth)

ROWS = [  # llama-bench -o json's rows, the fields read (a prompt-processing row: n_gen 0, skipped)
    {"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 900.0},
    {"n_prompt": 0, "n_gen": 32, "n_depth": 128, "avg_ts": 40.0},
    {"n_prompt": 0, "n_gen": 32, "n_depth": 1024, "avg_ts": 25.0},
]


def test_llama_bench_rows_become_ms_a_token_by_depth():
    assert growth.parse_llama_bench(json.dumps(ROWS)) == {128: 25.0, 1024: 40.0}  # 1000 / 40 and 1000 / 25


def test_the_gguf_argument_names_a_shape_a_dtype_and_a_file():
    assert growth.gguf_argument("135m:bfloat16=/tmp/a b.gguf") == (("135m", "bfloat16"), "/tmp/a b.gguf")
    for bad in ("135m=/tmp/x.gguf", "135m:bfloat16", "135m:bfloat16="):
        with pytest.raises(argparse.ArgumentTypeError, match="expected SHAPE:DTYPE=FILE"):
            growth.gguf_argument(bad)


@pytest.mark.cli
def test_a_run_prints_every_point_and_draws_them(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"assert sys.argv[sys.argv.index('-d') + 1] == '128,256'\n"
                    f"print(json.dumps({json.dumps(ROWS[1:2] + [{**ROWS[2], 'n_depth': 256}])}))\n")
    fake.chmod(0o755)
    measured = []
    monkeypatch.setattr(growth, "minillm_ms", lambda shape, path, c, dtype, steps, threads:
                        measured.append((path, c)) or {128: 30.0, 256: 31.0}[c] + (path == "no-fast"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setattr(sys, "argv", ["decode_growth.py", "--dtypes", "float32", "--contexts", "128", "256",
                                      "--llama-bench", str(fake), "--gguf", f"135m:float32={tmp_path / 'm.gguf'}",
                                      "--plot", str(tmp_path / "growth.png")])
    growth.main()
    out = capsys.readouterr().out
    assert measured == [("default", 128), ("default", 256), ("no-fast", 128), ("no-fast", 256)]
    assert "| 135m | minillm | float32 | 30.0 | 31.0 |" in out
    assert "| 135m | minillm --no-fast | float32 | 31.0 | 32.0 |" in out
    assert "| 135m | llama.cpp | float32 | 25.0 | 40.0 |" in out
    assert os.path.getsize(tmp_path / "growth.png") > 10_000


@pytest.mark.cli
def test_a_context_past_the_models_is_one_line_naming_it():
    with pytest.raises(SystemExit, match=r"minillm 135m float32 default at context 9000 failed: ValueError: max_seq_len"):
        growth.minillm_ms("135m", "default", 9000, "float32", 2, 1)
