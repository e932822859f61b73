"""What-if: the best TTFT and TPOT a model could reach on some hardware, from the roofline.

No model is run. For a request of P prompt tokens and N output tokens:

    TTFT  = floor(prefill of P tokens)                          (the 1st token comes from prefill)
    TPOT  = mean over k = 1..N-1 of floor(decode at context P + k)
    e2e   = TTFT + TPOT · (N - 1)

where floor(cost) = max(FLOPs / peak_flops, bytes / mem_bandwidth) (Williams et al. 2009;
costs from :mod:`minillm.costs`). These are lower bounds: real systems reach perhaps
50-80% of them (datasheet peaks are optimistic; kernels, launches and scheduling add time).

Tensor parallelism over N devices (``tensor_parallel_size``): each device does 1/N of the FLOPs and
reads 1/N of the bytes, then waits for the pass's 2 · n_layers all-reduces of [tokens, d_model]
(:func:`~minillm.costs.tensor_parallel_comm_seconds`, on the critical path: a layer cannot start
before the previous one's sum is in):

    floor_N(pass) = floor(pass) / N  +  2 · n_layers · all_reduce(tokens · d_model · dtype_bytes)

Communication does not shrink with N, so past some N, or on a slow interconnect, it eats what the
split saves: decode (one token, microseconds of bytes) pays mostly the latency, prefill the bandwidth.

Load or recompute (prompt caching beyond the KV pool, lesson 08): a prefix whose K/V sits in a
slower tier (host memory, disk) can be read back or prefilled again; the cheaper wins::

    load      = prefix_tokens · kv_bytes_per_token / tier bandwidth
    recompute = floor(prefill of prefix_tokens after cached_tokens)

:func:`load_or_recompute` answers it for any model, device and tier; the serving engine asks it
for every run of blocks it finds in its tiers, with the bandwidth it measured.

Example configs ship in ``minillm/configs/`` (the models' Hugging Face config.json):
``gpt2-124m``, ``llama-2-7b``, ``llama-3-8b``, ``mistral-7b``, ``qwen2.5-0.5b``, ``qwen3-0.6b``,
``smollm2-135m-instruct``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .config import ModelConfig
from .costs import (PhaseCost, decode_cost, kv_bytes_per_token, kv_transfer_seconds, prefill_cost,
                    tensor_parallel_comm_seconds, weights_bytes)
from .errors import ConfigError
from .hardware import HardwareProfile


@dataclass(frozen=True)
class WhatIf:
    """Predicted (roofline-floor) latencies of one request shape on one device.

    Attributes:
        hardware: the profile used.
        prompt_tokens, output_tokens, dtype_bytes, batch_size: the request shape.
        ttft_ms: prefill floor (ms).
        tpot_ms: mean decode-step floor (ms); None when output_tokens == 1.
        e2e_ms: ttft_ms + tpot_ms · (output_tokens - 1) (ms).
        output_throughput_tok_s: batch_size / TPOT, tokens per second across the batch
            during decode (None without decode steps).
        prefill: the prefill PhaseCost (whole batch).
        decode_first, decode_last: the first and last decode steps' PhaseCost (whole batch).
        prefill_bound, decode_bound: "compute-bound" or "memory-bound" (decode: summed
            over all steps, compute floors against memory floors).
        weights_bytes: bytes of all parameters.
        kv_bytes_per_token: KV cache bytes per token of one sequence.
        kv_bytes_per_request: (prompt + output tokens) · kv_bytes_per_token, one sequence.
        memory_bytes_needed: weights + KV of the whole batch at the end of generation.
        fits_in_memory: memory_bytes_needed <= hardware.memory_bytes (None if unknown).
        tensor_parallel_size: N devices sharing the model (1: one device); with N > 1, the
            times include the all-reduces and memory_bytes_needed is one device's share (its 1/N
            of the weights and KV, plus the replicated embedding table).
        interconnect_gb_s, latency_us: each device's link, GB/s one direction, and one ring step's latency (an all-reduce pays 2(N-1)).
        prefill_comm_ms: the prefill's all-reduce time (0 with N = 1), part of ttft_ms.
        decode_comm_ms: one decode step's all-reduce time, part of tpot_ms.
    """

    hardware: HardwareProfile
    prompt_tokens: int
    output_tokens: int
    dtype_bytes: int
    batch_size: int
    ttft_ms: float
    tpot_ms: float | None
    e2e_ms: float
    output_throughput_tok_s: float | None
    prefill: PhaseCost
    decode_first: PhaseCost | None
    decode_last: PhaseCost | None
    prefill_bound: str
    decode_bound: str | None
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    memory_bytes_needed: int
    fits_in_memory: bool | None
    tensor_parallel_size: int = 1
    interconnect_gb_s: float | None = None
    latency_us: float = 0.0
    prefill_comm_ms: float = 0.0
    decode_comm_ms: float = 0.0


def predict(
    config: ModelConfig,
    hw: HardwareProfile,
    prompt_tokens: int,
    output_tokens: int,
    dtype_bytes: int = 2,
    batch_size: int = 1,
    tensor_parallel_size: int = 1,
    interconnect_gb_s: float | None = None,
    latency_us: float = 0.0,
) -> WhatIf:
    """Roofline-floor TTFT, TPOT and e2e of batch_size requests of the same shape.

    The batch is prefilled in one pass (every request's TTFT is that pass) and decoded
    in lockstep, one token per request per step (static batching: weights are read once
    per step for the whole batch, KV per request). Each decode step k (k = 1..output_tokens-1)
    feeds the k-th output token, so its context after the write is prompt_tokens + k.
    With ``tensor_parallel_size`` N > 1, every pass is split over N devices joined by links of
    ``interconnect_gb_s`` (GB/s, one direction) and ``latency_us`` per ring step (module docstring).
    Raises ValueError for prompt_tokens < 1, output_tokens < 1, batch_size < 1, N < 1, or N > 1
    without an interconnect bandwidth > 0.
    """
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError(f"prompt and output tokens must be >= 1, got {prompt_tokens} and {output_tokens}")
    N = tensor_parallel_size
    if N < 1 or (N > 1 and not (interconnect_gb_s or 0) > 0):
        raise ValueError(f"tensor_parallel_size must be >= 1 (got {N}), and > 1 needs interconnect_gb_s > 0 "
                         f"(got {interconnect_gb_s})")

    def comm_s(n_tokens: int) -> float:
        if N == 1:
            return 0.0
        return tensor_parallel_comm_seconds(config, n_tokens, dtype_bytes, N, interconnect_gb_s, latency_us * 1e-6)

    prefill = prefill_cost(config, prompt_tokens, dtype_bytes, batch_size=batch_size)
    prefill_compute, prefill_memory = (t / N for t in _floors(prefill, hw))
    steps = [decode_cost(config, prompt_tokens + k, dtype_bytes, batch_size) for k in range(1, output_tokens)]
    floors = [tuple(t / N for t in _floors(step, hw)) for step in steps]
    step_comm_s = comm_s(batch_size)
    decode_s = sum(max(f) + step_comm_s for f in floors)
    tpot_s = decode_s / len(steps) if steps else None
    prefill_comm_s = comm_s(batch_size * prompt_tokens)
    ttft_s = max(prefill_compute, prefill_memory) + prefill_comm_s

    kv_token = kv_bytes_per_token(config, dtype_bytes)
    kv_request = (prompt_tokens + output_tokens) * kv_token
    w_bytes = weights_bytes(config, dtype_bytes)
    embed_bytes = config.vocab_size * config.d_model * dtype_bytes  # replicated on every device
    needed = (w_bytes - embed_bytes + batch_size * kv_request) / N + embed_bytes if N > 1 else \
        w_bytes + batch_size * kv_request
    return WhatIf(
        hardware=hw,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        dtype_bytes=dtype_bytes,
        batch_size=batch_size,
        ttft_ms=ttft_s * 1e3,
        tpot_ms=tpot_s * 1e3 if tpot_s is not None else None,
        e2e_ms=(ttft_s + decode_s) * 1e3,
        output_throughput_tok_s=batch_size / tpot_s if tpot_s else None,
        prefill=prefill,
        decode_first=steps[0] if steps else None,
        decode_last=steps[-1] if steps else None,
        prefill_bound=_bound(prefill_compute, prefill_memory),
        decode_bound=_bound(sum(f[0] for f in floors), sum(f[1] for f in floors)) if steps else None,
        weights_bytes=w_bytes,
        kv_bytes_per_token=kv_token,
        kv_bytes_per_request=kv_request,
        memory_bytes_needed=int(needed),
        fits_in_memory=needed <= hw.memory_bytes if hw.memory_bytes else None,
        tensor_parallel_size=N,
        interconnect_gb_s=interconnect_gb_s,
        latency_us=latency_us,
        prefill_comm_ms=prefill_comm_s * 1e3,
        decode_comm_ms=step_comm_s * 1e3,
    )


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
        raise ValueError(f"prompt_tokens must be >= 1 (a prefill has at least one token), got {prompt_tokens}")
    transfer_s = kv_transfer_seconds(config, prompt_tokens, dtype_bytes, link_gbit_s)
    prefill_s = max(_floors(prefill_cost(config, prompt_tokens, dtype_bytes), hw))
    return transfer_s / prefill_s


@dataclass(frozen=True)
class LoadOrRecompute:
    """One prefix, two ways to get its K/V back into the pool.

    Attributes:
        prefix_tokens: tokens whose K/V is in the slower tier.
        cached_tokens: tokens before them already in the pool (the context the recompute attends to).
        kv_bytes: prefix_tokens · kv_bytes_per_token: what a load reads.
        tier_bytes_per_s: the tier's bandwidth used, bytes/s.
        load_ms: kv_bytes / tier_bytes_per_s (ms).
        recompute_ms: the prefix's prefill (ms): its roofline floor / prefill_efficiency.
        prefill_efficiency: the fraction of the roofline floor the prefill is assumed to reach (1: the floor).
        choice: "load" when load_ms < recompute_ms, else "recompute".
    """

    prefix_tokens: int
    cached_tokens: int
    kv_bytes: int
    tier_bytes_per_s: float
    load_ms: float
    recompute_ms: float
    choice: str
    prefill_efficiency: float = 1.0

    @property
    def break_even_bytes_per_s(self) -> float:
        """bytes/s: kv_bytes / recompute time, the tier bandwidth at which a load takes as long as the
        recompute; a faster tier loads, a slower one recomputes."""
        return self.kv_bytes / (self.recompute_ms / 1e3)


# Read bandwidths of the places a prefix's K/V can come back from, GB/s one way, sequential: what
# `minillm whatif --tier-bandwidth NAME` uses (host memory is the --hardware's own: see cli/roofline.py).
# PCIe x16 to a GPU: 32 (4.0) and 64 (5.0) GB/s, the PCI-SIG figures minillm's --interconnect-gb-s help
# quotes too; an NVMe SSD on PCIe 4.0: 5 GB/s (datasheets say 5-7); a SATA SSD: 0.5 GB/s (SATA III's
# 6 Gbit/s, 8b/10b coded, is 0.6); a network's line rate / 8: 10 GbE 1.25, 100 GbE 12.5 (LMCache's and
# Mooncake's remote stores).
TIER_GB_S: dict[str, float] = {"pcie4": 32.0, "pcie5": 64.0, "nvme": 5.0, "sata-ssd": 0.5, "10gbe": 1.25,
                               "100gbe": 12.5}


def prefill_floor_s(config: ModelConfig, hw: HardwareProfile, n_tokens: int, dtype_bytes: int,
                    cached_tokens: int = 0) -> float:
    """Seconds: the roofline floor of prefilling ``n_tokens`` after ``cached_tokens``, one sequence,
    max(FLOPs / peak_flops, bytes / mem_bandwidth) of :func:`~minillm.costs.prefill_cost`.
    Raises ValueError as prefill_cost does."""
    return max(_floors(prefill_cost(config, n_tokens, dtype_bytes, cached_tokens), hw))


def load_or_recompute(config: ModelConfig, hw: HardwareProfile, tier_bytes_per_s: float, prefix_tokens: int,
                      cached_tokens: int = 0, dtype_bytes: int = 2, prefill_efficiency: float = 1.0
                      ) -> LoadOrRecompute:
    """Is reading a prefix's K/V from a tier faster than prefilling it again?

        load      = prefix_tokens · kv_bytes_per_token(config, dtype_bytes) / tier_bytes_per_s
        recompute = prefill_floor_s(config, hw, prefix_tokens, dtype_bytes, cached_tokens) / prefill_efficiency
                    (the floor: max(FLOPs / hw.peak_flops, bytes / hw.mem_bandwidth) of prefill_cost)

    With ``prefill_efficiency`` 1 the recompute time is the roofline floor (Williams et al. 2009): a
    real prefill is slower, so a "recompute" verdict is safe and a "load" one conservative. The
    serving engine passes the fraction of the floor its own prefills reached (measured), so that a
    measured load is weighed against a realistic prefill, not an ideal one. The load is bandwidth only (a
    file's open and a copy into the pool add a little; the engine measures the tier's bandwidth
    with them). LMCache and SGLang's HiCache make the same trade: on a GPU a fast prefill can beat a
    slow disk; on a CPU the prefill is so slow that any tier wins.

    Args:
        config: the model.
        hw: the device that would recompute (peak_flops FLOP/s, mem_bandwidth bytes/s).
        tier_bytes_per_s: the tier's read bandwidth, bytes/s (host memory: tens of GB/s; a disk: 0.2-7 GB/s).
        prefix_tokens: tokens to get back, >= 1.
        cached_tokens: tokens before them already in the pool, >= 0.
        dtype_bytes: bytes of one weight and one K or V element (4 for float32).
        prefill_efficiency: the fraction of the roofline floor a prefill reaches here, in (0, 1]-ish
            (1: the floor itself; 0.1: ten times slower).

    Raises ValueError for prefix_tokens < 1, cached_tokens < 0, or tier_bytes_per_s or
    prefill_efficiency not > 0 (NaN included).
    """
    if not tier_bytes_per_s > 0:
        raise ValueError(f"tier_bytes_per_s must be > 0 (bytes per second), got {tier_bytes_per_s}")
    if not prefill_efficiency > 0:
        raise ValueError(f"prefill_efficiency must be > 0 (a fraction of the roofline floor), got {prefill_efficiency}")
    if prefix_tokens < 1:
        raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
    kv_bytes = prefix_tokens * kv_bytes_per_token(config, dtype_bytes)
    load_s = kv_bytes / tier_bytes_per_s
    recompute_s = prefill_floor_s(config, hw, prefix_tokens, dtype_bytes, cached_tokens) / prefill_efficiency
    return LoadOrRecompute(prefix_tokens, cached_tokens, kv_bytes, tier_bytes_per_s, load_s * 1e3,
                           recompute_s * 1e3, "load" if load_s < recompute_s else "recompute", prefill_efficiency)


def _floors(cost: PhaseCost, hw: HardwareProfile) -> tuple[float, float]:
    """(compute floor, memory floor) in seconds."""
    return cost.flops / hw.peak_flops, cost.bytes / hw.mem_bandwidth


def _bound(compute_s: float, memory_s: float) -> str:
    return "compute-bound" if compute_s >= memory_s else "memory-bound"


# -- configs by name ------------------------------------------------------------------


def example_configs() -> list[str]:
    """Names of the configs shipped in ``minillm/configs/`` (without .json)."""
    folder = resources.files("minillm") / "configs"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_config(name_or_path: str) -> ModelConfig:
    """A ModelConfig from a path (a config.json or a folder holding one), a shipped
    example name (``llama-3-8b``), or a model already in the weights directory.

    Raises ConfigError when it is none of these.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return ModelConfig.from_json(path)
    shipped = resources.files("minillm") / "configs" / f"{name_or_path}.json"
    if shipped.is_file():
        return ModelConfig.from_hf(json.loads(shipped.read_text()))
    from .formats import weights

    if weights.is_model_name(name_or_path) and weights.is_downloaded(name_or_path):
        return ModelConfig.from_json(weights.model_dir(name_or_path))
    raise ConfigError(
        f"no config {name_or_path!r}: give a path to a config.json or model folder, "
        f"a downloaded model, or one of: {', '.join(example_configs())}"
    )

