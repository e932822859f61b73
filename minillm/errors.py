"""The errors minillm raises for bad input: each one is a single readable line.

The CLI prints ``str(error)`` for any :class:`MiniLLMError` and exits with code 1,
so every message names the problem and the fix.
"""


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
