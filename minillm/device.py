"""Which device and dtype a model runs in: one place decides, for loading, the roofline and the CLI."""

from __future__ import annotations

import torch

# float64 is no speed choice: it is how a lesson shows two paths agree to the last bit.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_device(device) -> torch.device:
    """cuda when available, else cpu; an explicit device that is not available raises ValueError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda, cuda:N or mps, got {device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' is not available on this machine; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' is not available on this machine; use --device cpu")
    return device


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """Default float32 (bfloat16 on cuda); names are the keys of DTYPES. Raises ValueError for another."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
