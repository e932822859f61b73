"""Where minillm keeps files on disk: the weights folder (models, calibration.json, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path

# The folder that holds minillm/ when running from a source checkout (tests patch it).
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def weights_dir(override: str | os.PathLike | None = None) -> Path:
    """The folder that holds downloaded and converted models (it may not exist yet).

    Precedence: ``override`` (the CLI's --weights-dir), then $MINILLM_WEIGHTS, then
    ``weights/`` of a source checkout (a folder with pyproject.toml and weights/ next
    to the package), then the per-user cache ($XDG_CACHE_HOME/minillm or ~/.cache/minillm).
    """
    chosen = override or os.environ.get("MINILLM_WEIGHTS")
    if chosen:
        return Path(chosen).expanduser().absolute()
    if (SOURCE_ROOT / "pyproject.toml").is_file() and (SOURCE_ROOT / "weights").is_dir():
        return SOURCE_ROOT / "weights"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser().absolute() / "minillm"
