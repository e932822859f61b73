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
    raise NotImplementedError(
        "Exercise 12 (prefill cost, roofline) is not written yet: "
        "see lessons/05-compute-vs-memory-bound.md#arithmetic-intensity"
    )


def roofline(cost: PhaseCost, time_s: float, hw: HardwareProfile) -> Roofline:
    """Place a phase that did ``cost`` in ``time_s`` seconds on ``hw``'s roofline.

    The verdict: the larger floor names the bound (compute or memory; compute when the
    two are equal, at the ridge point), unless the measured time exceeds
    OVERHEAD_FACTOR × floor_s: then neither arithmetic nor
    memory traffic explains the time and the phase is "overhead-bound" (Python,
    dispatch, kernel launches, small unfused ops, synchronisation).

    Raises ValueError for time_s <= 0.
    """
    raise NotImplementedError(
        "Exercise 12 (prefill cost, roofline) is not written yet: "
        "see lessons/05-compute-vs-memory-bound.md#the-roofline"
    )
