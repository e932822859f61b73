"""Exercise 10: KV cache bytes per token, and the cost of one decode step.

Write ``kv_bytes_per_token(config, dtype_bytes)`` and ``decode_cost(config, context_len,
dtype_bytes, batch_size)``. For the latter you may use ``weights_bytes`` and
``flops_per_token`` (imported below); return a ``PhaseCost(flops, bytes, weights_bytes,
kv_read_bytes, kv_written_bytes)``: its ``arithmetic_intensity`` (FLOP per byte) then
tells whether decode is compute- or memory-bound.

Check:      minillm check ex10   (or: pytest tests/exercises -m ex10 --impl student)
Lesson:     lessons/05-compute-vs-memory-bound.md#arithmetic-intensity
            lessons/03-kv-cache.md#how-big-is-the-kv-cache
Reference:  minillm.costs.kv_bytes_per_token, minillm.costs.decode_cost
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

from minillm.config import ModelConfig
from minillm.costs import PhaseCost, flops_per_token, weights_bytes  # noqa: F401


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """KV cache bytes per token: 2 (K, V) · n_layers · n_kv_heads · head_dim · dtype_bytes."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * dtype_bytes


def decode_cost(config: ModelConfig, context_len: int, dtype_bytes: int, batch_size: int = 1) -> PhaseCost:
    """Cost of one decode step: one new token per sequence, attending to context_len keys.

    ``context_len`` is the cache length *after* the step's write (the new token included),
    so the first decode step after a prompt of P tokens has context_len = P + 1.

    FLOPs: flops_per_token(context_len) · batch_size.
    bytes: weights once + KV read of all context_len positions (min(context_len, W) in a
    sliding-window layer) + KV written for 1 position,
    both · batch_size. The same as ``prefill_cost(config, 1, dtype_bytes, context_len - 1)``.

    Raises ValueError for context_len < 1 or batch_size < 1.
    """
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    per_layer_pos = 2 * config.n_kv_heads * config.head_dim * dtype_bytes
    positions = context_len * config.n_layers
    flops = flops_per_token(config, context_len) * batch_size
    w = weights_bytes(config, dtype_bytes)
    kv_read = positions * per_layer_pos * batch_size
    kv_written = kv_bytes_per_token(config, dtype_bytes) * batch_size
    return PhaseCost(float(flops), float(w + kv_read + kv_written), float(w), float(kv_read), float(kv_written))
