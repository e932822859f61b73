"""Exercise 12: the cost of a prefill, and the roofline verdict on a phase.

Write ``prefill_cost`` (FLOPs and bytes of prefilling n_tokens onto cached_tokens, for a
batch) and ``roofline`` (both floors of a phase on some hardware, and which one binds).
For the former you may use the helpers imported below (``attention_params``,
``mlp_params``, ``lm_head_params``, ``attention_flops``, ``kv_bytes_per_token``,
``weights_bytes``); return a ``PhaseCost(flops, bytes, weights_bytes, kv_read_bytes,
kv_written_bytes)``, every field a float. For the latter return a ``Roofline`` with every
field; the checks grade the numbers and ``bound``, not the words of ``explanation``.
``decode_cost`` is ``prefill_cost`` of one token (exercise 10), so with both you can tell
why prefill is compute-bound and decode memory-bound.

Check:      minillm check ex12   (or: pytest tests/exercises -m ex12 --impl student)
Lesson:     lessons/05-compute-vs-memory-bound.md#the-roofline
Reference:  minillm.costs.prefill_cost, minillm.hardware.roofline
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

from minillm.config import ModelConfig
from minillm.costs import (PhaseCost, attention_flops, attention_params, kv_bytes_per_token,  # noqa: F401
                           lm_head_params, mlp_params, weights_bytes)
from minillm.hardware import OVERHEAD_FACTOR, HardwareProfile, Roofline  # noqa: F401


def prefill_cost(
    config: ModelConfig,
    n_tokens: int,
    dtype_bytes: int,
    cached_tokens: int = 0,
    batch_size: int = 1,
    last_only: bool = True,
) -> PhaseCost:
    """Cost of prefilling n_tokens per sequence onto a cache holding cached_tokens.

    FLOPs (per sequence, times batch_size):
        2 · layer params · n_tokens  +  2 · lm_head params · (1 if last_only else n_tokens)
      + causal attention_flops(n_tokens, cached_tokens)
    bytes:
        weights once (shared by the batch)
      + KV read:    (cached_tokens + n_tokens) positions · kv_bytes_per_token · batch_size
                    (attention reads the whole filled cache, the new entries included;
                    a sliding-window layer reads fewer: :func:`kv_positions_read`)
      + KV written: n_tokens · kv_bytes_per_token · batch_size

    Raises ValueError for n_tokens < 1, cached_tokens < 0 or batch_size < 1.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if cached_tokens < 0:
        raise ValueError(f"cached_tokens must be >= 0, got {cached_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    layer_params = config.n_layers * (attention_params(config) + mlp_params(config))
    head_tokens = 1 if last_only else n_tokens
    flops = (2.0 * layer_params * n_tokens + 2.0 * lm_head_params(config) * head_tokens
             + attention_flops(config, n_tokens, cached_tokens)) * batch_size
    per_layer_pos = 2 * config.n_kv_heads * config.head_dim * dtype_bytes
    total = cached_tokens + n_tokens
    positions = sum(total if config.window(l) is None else min(total, n_tokens + config.window(l) - 1)
                    for l in range(config.n_layers))
    kv_read = float(positions * per_layer_pos * batch_size)
    kv_written = float(n_tokens * kv_bytes_per_token(config, dtype_bytes) * batch_size)
    w = float(weights_bytes(config, dtype_bytes))
    return PhaseCost(float(flops), w + kv_read + kv_written, w, kv_read, kv_written)


def roofline(cost: PhaseCost, time_s: float, hw: HardwareProfile) -> Roofline:
    """Place a phase that did ``cost`` in ``time_s`` seconds on ``hw``'s roofline.

    The verdict: the larger floor names the bound (compute or memory; compute when the
    two are equal, at the ridge point), unless the measured time exceeds
    OVERHEAD_FACTOR × floor_s: then neither arithmetic nor
    memory traffic explains the time and the phase is "overhead-bound" (Python,
    dispatch, kernel launches, small unfused ops, synchronisation).

    Raises ValueError for time_s <= 0.
    """
    if not time_s > 0:
        raise ValueError(f"time_s must be > 0, got {time_s}")
    compute_floor = cost.flops / hw.peak_flops
    memory_floor = cost.bytes / hw.mem_bandwidth
    floor = max(compute_floor, memory_floor)
    if time_s > OVERHEAD_FACTOR * floor:
        bound = "overhead-bound"
    elif compute_floor >= memory_floor:
        bound = "compute-bound"
    else:
        bound = "memory-bound"
    return Roofline(
        time_s=time_s,
        arithmetic_intensity=cost.arithmetic_intensity,
        compute_floor_s=compute_floor,
        memory_floor_s=memory_floor,
        floor_s=floor,
        attained_flops=cost.flops / time_s,
        attained_bandwidth=cost.bytes / time_s,
        roofline_fraction=floor / time_s,
        bound=bound,
        explanation=f"{bound}: compute floor {compute_floor:.3g} s, memory floor {memory_floor:.3g} s, measured {time_s:.3g} s",
    )
