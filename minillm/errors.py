"""The errors minillm raises for bad input: each one is a single readable line.

The CLI prints ``str(error)`` for any :class:`MiniLLMError` and exits with code 1,
so every message names the problem and the fix. :func:`check_output_dir` is the
check that commands writing a folder run before their long work; :func:`check_positive_int`
the one check of every size and count.
"""

import numbers
import os
from pathlib import Path


class MiniLLMError(Exception):
    """Base class of every error meant for the user (one line, no traceback needed)."""


class ConfigError(MiniLLMError, ValueError):
    """A config.json field is missing, unknown or unsupported."""


class WeightsError(MiniLLMError):
    """A checkpoint is missing tensors, has unexpected ones, or has wrong shapes."""


class CacheFullError(MiniLLMError):
    """Writing K/V would go past the KV cache's ``max_seq_len``."""


class ModelNotFoundError(MiniLLMError):
    """A model name or path that cannot be found locally or downloaded."""


class EngineLostError(MiniLLMError):
    """The engine cannot run another step: a part of it is gone for good (a tensor-parallel rank died).
    A server answers /health with 503 and refuses new requests from then on."""


class OutputPathError(MiniLLMError):
    """An output folder that cannot be created or written to."""


def check_output_dir(path) -> Path:
    """Fail now, before any long work, when ``path`` cannot become a folder we can write into.

    Nothing is created or changed: the writer creates the folder (and missing parents) later.
    A folder that exists is fine; the files the command writes in it are replaced.

    Raises:
        OutputPathError: ``path``, or the nearest part of it that exists, is not a folder
            (a file is never replaced by a folder), or is a folder without write permission.
    """
    path = Path(path).expanduser().absolute()
    existing = path
    while not os.path.lexists(existing):  # lexists: a dangling symlink is in the way too
        existing = existing.parent
    if not existing.is_dir():
        where = "exists" if existing == path else f"cannot be created: {existing} exists"
        raise OutputPathError(f"{path} {where} and is not a folder; pass a folder path (it is created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write in {existing} (permission denied); pass a folder you can write to")
    return path


def check_positive_int(name: str, value) -> int:
    """``value`` as an int >= 1 (any integer type, numpy's too); ValueError naming ``name`` otherwise.

    A bool is refused (True is an int to Python, never a size), and so is a float such as 256.0,
    which would fail later inside torch.
    """
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)
