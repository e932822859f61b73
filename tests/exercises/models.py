"""Tiny random-weight minillm models for the prefill / decode / prefix-cache checks (no downloads)."""

from __future__ import annotations

from functools import lru_cache

import torch
from tiny_models import CONFIGS

from minillm import ModelConfig, Transformer


@lru_cache(maxsize=None)
def tiny_config(name: str) -> ModelConfig:
    """A config of tests/tiny_models.py: "llama_gqa" (4 heads, 2 KV heads, RoPE), "gpt2" (learned positions), ..."""
    family, kwargs = CONFIGS[name]
    return ModelConfig.from_hf({"model_type": family, **kwargs})


@lru_cache(maxsize=None)
def tiny_model(name: str, attn_impl: str = "eager") -> Transformer:
    """A 2-layer float32 model with seeded random weights; shared between checks, never modified."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(tiny_config(name), attn_impl=attn_impl)
    return model.eval().requires_grad_(False)


def prompt(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Token ids [batch, n] int64 in the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, n), generator=g)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """Seeded float32 normal values (the checks' tiny q, k, v, logits)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
