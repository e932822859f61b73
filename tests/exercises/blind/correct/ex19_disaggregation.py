"""Exercise 19: disaggregation's price, the K/V transfer time against the prefill time.

Write ``kv_transfer_seconds(config, prompt_tokens, dtype_bytes, link_gbit_s)``: how long a
prompt's K/V takes to cross a link from the prefill worker to the decode worker; then
``transfer_vs_prefill(config, prompt_tokens, dtype_bytes, link_gbit_s, hw)``: that time over the
prefill's roofline floor on the GPU ``hw``. Use ``prefill_cost`` (imported below) for the
prefill's FLOPs and bytes, and ``LINKS_GBIT_S`` for the links the lesson names. Compute the KV
bytes per token from the config yourself (exercise 10 has it).

Check:      minillm check ex19   (or: pytest tests/exercises -m ex19 --impl student)
Lesson:     lessons/10-disaggregation.md#the-price-moving-the-kv-cache
            lessons/10-disaggregation.md#when-splitting-pays-off
Reference:  minillm.costs.kv_transfer_seconds, minillm.whatif.transfer_vs_prefill
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

from minillm.config import ModelConfig
from minillm.costs import LINKS_GBIT_S, prefill_cost  # noqa: F401
from minillm.hardware import HardwareProfile


def kv_transfer_seconds(config: ModelConfig, prompt_tokens: int, dtype_bytes: int, link_gbit_s: float) -> float:
    """Seconds to send a prompt's K/V from a prefill worker to a decode worker: a floor.

    bytes   = prompt_tokens · kv_bytes_per_token
            = prompt_tokens · 2 (K and V) · n_layers · n_kv_heads · head_dim · dtype_bytes
    seconds = bytes / (link_gbit_s · 1e9 / 8)

    Every layer's K and V for every prompt position crosses the link (the output tokens' K/V is
    made on the decode worker and never does). Bandwidth only: latency, protocol overhead and
    contention add to it (lesson 10, "Link bandwidths"; DistServe, Zhong et al. 2024).

    Args:
        config: the model; only n_layers, n_kv_heads and head_dim matter.
        prompt_tokens: tokens of the prompt, >= 0 (0 sends nothing: 0.0).
        dtype_bytes: bytes of one cached K or V element (2 for bfloat16), >= 1.
        link_gbit_s: the link's bandwidth in ONE direction, in gigabits per second (1e9 bits/s)
            as link speeds are quoted: 400 for InfiniBand NDR, 100 for 100 GbE (LINKS_GBIT_S).

    Returns seconds, a float.
    Raises ValueError for prompt_tokens < 0, dtype_bytes < 1 or link_gbit_s not > 0 (NaN included).
    """
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    if dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be >= 1, got {dtype_bytes}")
    if not link_gbit_s > 0:
        raise ValueError(f"link_gbit_s must be > 0, got {link_gbit_s}")
    kv = 2 * config.n_layers * config.n_kv_heads * config.head_dim * dtype_bytes
    return float(prompt_tokens * kv / (link_gbit_s * 1e9 / 8))


def transfer_vs_prefill(config: ModelConfig, prompt_tokens: int, dtype_bytes: int, link_gbit_s: float,
                        hw: HardwareProfile) -> float:
    """The K/V transfer time over the prefill time, for one prompt: does disaggregation pay?

        transfer = kv_transfer_seconds(config, prompt_tokens, dtype_bytes, link_gbit_s)
        prefill  = max(FLOPs / hw.peak_flops, bytes / hw.mem_bandwidth)
                   of prefill_cost(config, prompt_tokens, dtype_bytes)     (one sequence, empty cache)
        ratio    = transfer / prefill

    The prefill time is its roofline floor (Williams et al. 2009), ``predict``'s TTFT; a real
    prefill is slower, which makes the ratio smaller. Below 1 the transfer costs less than
    the prefill it offloads; above 1, sending the K/V takes longer than recomputing it
    (lesson 10, "When splitting pays off").

    Args:
        config: the model.
        prompt_tokens: tokens of the prompt, >= 1.
        dtype_bytes: bytes of one weight and of one cached K or V element (2 for bfloat16).
        link_gbit_s: the link's bandwidth in one direction, Gb/s as quoted (LINKS_GBIT_S).
        hw: the GPU that would run the prefill (peak_flops in FLOP/s, mem_bandwidth in bytes/s).

    Returns the ratio, a float.
    Raises ValueError for prompt_tokens < 1, dtype_bytes < 1 or link_gbit_s not > 0 (NaN included).
    """
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    transfer = kv_transfer_seconds(config, prompt_tokens, dtype_bytes, link_gbit_s)
    cost = prefill_cost(config, prompt_tokens, dtype_bytes)
    prefill = max(cost.flops / hw.peak_flops, cost.bytes / hw.mem_bandwidth)
    return float(transfer / prefill)
