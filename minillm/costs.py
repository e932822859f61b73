"""The cost model: FLOPs and bytes of prefill and decode, from the config alone.

Pure arithmetic on a :class:`ModelConfig`; no model, no tensors. Two numbers per phase:

- **FLOPs**: matrix multiplies only, 2 FLOPs per multiply-add (Kaplan et al. 2020,
  "Scaling Laws", Table 1: forward ≈ 2·N + 2·n_layers·n_ctx·d_attn per token).
  Norms, RoPE, softmax, GELU/SiLU, residual adds and biases are O(d_model) per token
  and left out, as ``torch.utils.flop_counter.FlopCounterMode`` leaves them out.
- **bytes**: traffic to main memory (HBM / DRAM), the convention of the LLM
  inference literature (Pope et al. 2022, "Efficiently Scaling Transformer
  Inference"; Databricks 2023, "LLM Inference Performance Engineering", MBU):

      bytes = weights bytes          every distinct parameter read once per forward pass
            + KV read                every cache position after this pass's write, once
                                     (a sliding-window layer: only the positions some query
                                     of the pass sees, min(cached + n, n + W - 1))
            + KV written             the new tokens' K and V

  Not counted: activations (a few · d_model values per token per layer, kB for
  decode; prefill is compute-bound anyway), the logits, the token ids.

Two conventions to know:

- **The whole embedding table counts as read.** Matches ``model.weights_bytes()``
  and the MBU convention. It is exact for a tied model (the LM head *is* the
  embedding and reads all of it); an untied model's embedding lookup really reads
  only its rows, so its bytes are overstated by up to vocab·d_model·dtype_bytes
  (about 6% for Llama-3-8B; GPT-2's learned positions add max_seq_len·d_model).
- **Attention FLOPs are the causal ones**: token i of a prefill attends to
  cached_tokens + i + 1 keys (what a causal kernel such as FlashAttention computes),
  at most W of them in a sliding-window layer (Mistral's ``sliding_window``).
  The ``eager`` attention of ``model.py`` multiplies the whole masked rectangle
  and throws half away; ``attention_flops(..., causal=False)`` counts that.
  (FlopCounterMode sees eager attention's matmuls; in torch 2.13 it counts nothing
  for ``scaled_dot_product_attention`` on CPU, so compare against eager.)

The prefill pass runs the LM head on the last position only (``last_only=True``
in :func:`minillm.phases.prefill`), so its FLOPs do too, unless ``last_only=False``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class PhaseCost:
    """FLOPs and bytes of memory traffic of one forward pass (a prefill or a decode step).

    Attributes:
        flops: floating-point operations (FLOP), matmuls only.
        bytes: bytes moved to/from main memory: weights + kv_read + kv_written.
        weights_bytes, kv_read_bytes, kv_written_bytes: the parts of ``bytes``
            (0 when the cost was built by hand from two numbers).
    """

    flops: float
    bytes: float
    weights_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_written_bytes: float = 0.0

    @property
    def arithmetic_intensity(self) -> float:
        """FLOP per byte moved: the x-axis of the roofline (Williams et al. 2009)."""
        return self.flops / self.bytes if self.bytes else float("inf")


# -- parameters ----------------------------------------------------------------------


def attention_params(config: ModelConfig) -> int:
    """Weights of q, k, v, o projections in one layer (no biases).

    q, o: d_model × n_heads·head_dim each; k, v: d_model × n_kv_heads·head_dim each (GQA).
    """
    c = config
    return 2 * c.d_model * c.n_heads * c.head_dim + 2 * c.d_model * c.n_kv_heads * c.head_dim


def mlp_params(config: ModelConfig) -> int:
    """Weights of one MLP (no biases): 3·d_model·d_mlp for SwiGLU (gate, up, down), 2· for GELU."""
    n_mats = 3 if config.gated_mlp else 2
    return n_mats * config.d_model * config.d_mlp


def lm_head_params(config: ModelConfig) -> int:
    """d_model · vocab_size: the LM head's matrix (the embedding itself when tied)."""
    return config.d_model * config.vocab_size


def matmul_params(config: ModelConfig) -> int:
    """Parameters a token multiplies through: all linear layers and the LM head.

    n_layers · (attention + MLP) + LM head. Not the embedding lookup (a gather,
    no arithmetic), norms or biases. A tied LM head counts here: it is a matmul.
    """
    return config.n_layers * (attention_params(config) + mlp_params(config)) + lm_head_params(config)


def weights_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of every distinct parameter, from the config; equals ``model.weights_bytes()``.

    Counts the token embedding (vocab·d_model), GPT-2's learned positions
    (max_seq_len·d_model), per layer the projections, their biases and two norms
    (RMSNorm: weight; LayerNorm: weight and bias) and Qwen3's QK-norm weights (2·head_dim),
    the final norm, and the LM head
    only when it is not tied to the embedding.
    """
    return _n_params(config) * dtype_bytes


def _n_params(config: ModelConfig) -> int:
    c = config
    norm = c.d_model if c.uses_rope else 2 * c.d_model  # RMSNorm weight | LayerNorm weight + bias
    attn_bias = ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim if c.qkv_bias else 0) + (c.d_model if c.o_bias else 0)
    qk_norm = 2 * c.head_dim if c.qk_norm else 0  # one RMSNorm weight for q's heads, one for k's
    mlp_bias = ((2 if c.gated_mlp else 1) * c.d_mlp + c.d_model) if c.mlp_bias else 0
    layer = attention_params(c) + mlp_params(c) + attn_bias + mlp_bias + 2 * norm + qk_norm
    embed = c.vocab_size * c.d_model + (0 if c.uses_rope else c.max_seq_len * c.d_model)
    head = 0 if c.tie_word_embeddings else lm_head_params(c)
    return embed + c.n_layers * layer + norm + head


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """KV cache bytes per token: 2 (K, V) · n_layers · n_kv_heads · head_dim · dtype_bytes."""
    return config.kv_bytes_per_token(dtype_bytes)


# Per direction, in Gb/s as the specifications quote them (a K/V transfer goes one way; lesson 10).
# NVLink 4: H100 datasheet, 900 GB/s per GPU counting both directions -> 450 GB/s = 3,600 Gb/s one way.
# InfiniBand NDR: 400 Gb/s a port. Ethernet: its name.
LINKS_GBIT_S: dict[str, float] = {"NVLink 4": 3600.0, "InfiniBand NDR": 400.0, "100 GbE": 100.0, "10 GbE": 10.0}


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
    _check(prompt_tokens >= 0, f"prompt_tokens must be >= 0, got {prompt_tokens}")
    _check(dtype_bytes >= 1, f"dtype_bytes must be >= 1, got {dtype_bytes}")
    _check(link_gbit_s > 0, f"link_gbit_s must be > 0 (gigabits per second, one direction), got {link_gbit_s}")
    n_bytes = prompt_tokens * kv_bytes_per_token(config, dtype_bytes)
    return n_bytes / (link_gbit_s * 1e9 / 8)


def all_reduce_seconds(n_bytes: float, world_size: int, interconnect_gb_s: float, latency_s: float = 0.0) -> float:
    """Seconds of one ring all-reduce of an ``n_bytes`` tensor over ``world_size`` ranks (the α-β model).

        seconds = 2(N-1) · latency_s  +  2(N-1)/N · n_bytes / (interconnect_gb_s · 1e9)

    A ring all-reduce is a reduce-scatter then an all-gather, N-1 steps each; in every step each
    rank sends 1/N of the tensor to its neighbour (Thakur, Rabenseifner & Gropp 2005, "Optimization
    of Collective Communication Operations in MPICH", section 4; Patarasuk & Yuan 2009). So each rank
    sends 2(N-1)/N of the bytes whatever N is, and pays 2(N-1) message latencies. With ``latency_s``
    0 it is a floor, bandwidth alone.

    Args:
        n_bytes: bytes of the tensor every rank holds (e.g. T · d_model · dtype_bytes).
        world_size: N >= 1 (1: no communication, 0.0).
        interconnect_gb_s: each rank's bandwidth in one direction, GB/s (1e9 bytes/s; NVLink 4 on
            an H100: 450 GB/s each way; PCIe 5 x16: about 64).
        latency_s: the time one ring step's message takes however small, seconds; the all-reduce pays
            it 2(N-1) times (a measured small all-reduce's time divided by 2(N-1) gives it).

    Raises ValueError for n_bytes < 0, world_size < 1, interconnect_gb_s not > 0 or latency_s < 0.
    """
    _check(n_bytes >= 0, f"n_bytes must be >= 0, got {n_bytes}")
    _check(world_size >= 1, f"world_size must be >= 1, got {world_size}")
    _check(interconnect_gb_s > 0, f"interconnect_gb_s must be > 0 (GB/s, one direction), got {interconnect_gb_s}")
    _check(latency_s >= 0, f"latency_s must be >= 0, got {latency_s}")
    return 2 * (world_size - 1) * latency_s + ring_all_reduce_bytes(n_bytes, world_size) / (interconnect_gb_s * 1e9)


def ring_all_reduce_bytes(n_bytes: float, world_size: int) -> float:
    """Bytes each rank sends in one ring all-reduce of an ``n_bytes`` tensor: 2(N-1)/N · n_bytes.

    N-1 reduce-scatter steps then N-1 all-gather steps, each sending 1/N of the tensor to the
    next rank (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009). N = 1 sends nothing.
    """
    return 2 * (world_size - 1) / world_size * n_bytes


def all_reduce_bytes_per_layer(config: ModelConfig, n_tokens: int, world_size: int, dtype_bytes: int) -> float:
    """Bytes each rank sends over the ring in one tensor-parallel layer (and receives: as many).

        tensor      = n_tokens · d_model · dtype_bytes          the activations [n_tokens, d_model]
        per layer   = 2 all-reduces · 2(N-1)/N · tensor         after o_proj and after down_proj

    Megatron-style tensor parallelism sums two partial outputs a layer, both of the residual
    stream's width d_model (not d_mlp: down_proj's output is d_model wide). A ring all-reduce is
    a reduce-scatter then an all-gather, N-1 steps each, every step sending 1/N of the tensor to
    the next rank: 2(N-1)/N of it per rank, whatever N (Thakur, Rabenseifner & Gropp 2005;
    Patarasuk & Yuan 2009). The activations travel in the model's dtype. N = 1 sends nothing.
    Times n_layers for a whole pass; :func:`all_reduce_seconds` turns one all-reduce into time.

    Args:
        config: the model; only d_model matters.
        n_tokens: tokens of the pass, all sequences of the batch (a decode step of B sequences: B), >= 0.
        world_size: N, the ranks, >= 1.
        dtype_bytes: bytes of one activation (2 for bfloat16, 4 for float32), >= 1.

    Returns bytes, a float.
    Raises ValueError for n_tokens < 0, world_size < 1 or dtype_bytes < 1.
    """
    _check(n_tokens >= 0, f"n_tokens must be >= 0, got {n_tokens}")
    _check(world_size >= 1, f"world_size must be >= 1, got {world_size}")
    _check(dtype_bytes >= 1, f"dtype_bytes must be >= 1, got {dtype_bytes}")
    return 2 * ring_all_reduce_bytes(n_tokens * config.d_model * dtype_bytes, world_size)


def tensor_parallel_comm_seconds(config: ModelConfig, n_tokens: int, dtype_bytes: int, world_size: int,
                                 interconnect_gb_s: float, latency_s: float = 0.0) -> float:
    """Seconds a tensor-parallel forward pass of ``n_tokens`` (all sequences of the batch) spends in all-reduces.

    Megatron-style tensor parallelism (minillm/distributed/tensor_parallel.py) sums two partial
    outputs per layer, after attention's o_proj and after the MLP's down_proj: 2 · n_layers ring
    all-reduces of [n_tokens, d_model] (:func:`all_reduce_seconds`). The logits' all-gather
    ([rows, vocab/N] from each rank) is left out: it is one per pass, not one per layer.

    Raises ValueError as :func:`all_reduce_seconds` does, or for n_tokens < 0.
    """
    _check(n_tokens >= 0, f"n_tokens must be >= 0, got {n_tokens}")
    one = all_reduce_seconds(n_tokens * config.d_model * dtype_bytes, world_size, interconnect_gb_s, latency_s)
    return 2 * config.n_layers * one


def kv_positions_read(config: ModelConfig, n_tokens: int, cached_tokens: int = 0) -> int:
    """Cache positions a pass of n_tokens after cached_tokens reads, summed over layers.

    A full-attention layer reads all cached_tokens + n_tokens. A sliding-window layer (W)
    reads only what its first query still sees onward: min(cached_tokens + n_tokens, n_tokens + W - 1),
    for a decode step min(context, W). Equals what ``model.py`` hands to attention.
    """
    total = cached_tokens + n_tokens

    def read(window: int | None) -> int:
        return total if window is None else min(total, n_tokens + window - 1)

    return sum(read(config.window(layer)) for layer in range(config.n_layers))


def _attended_pairs(n_tokens: int, cached_tokens: int, window: int | None) -> float:
    """Query-key pairs of a causal pass: sum over queries of min(keys before and at it, W)."""
    first, last = cached_tokens + 1, cached_tokens + n_tokens  # keys the first and last query see
    if window is None or last <= window:
        return n_tokens * cached_tokens + n_tokens * (n_tokens + 1) / 2
    unclipped = max(0, window - first + 1)  # queries that see fewer than W keys: first .. W
    return unclipped * (first + window) / 2 + (n_tokens - unclipped) * window


# -- FLOPs ---------------------------------------------------------------------------


def flops_per_token(config: ModelConfig, context_len: int) -> float:
    """FLOPs of one token's forward pass when it attends to ``context_len`` keys.

        2 · matmul_params                                  every weight: one multiply-add
      + 4 · n_layers · n_heads · head_dim · context_len    q·kᵀ and pattern·v (2 each)

    (Kaplan et al. 2020, Table 1, with the attention term per query head; a sliding-window
    layer counts min(context_len, W) keys.)
    """
    c = config
    keys = sum(min(context_len, c.window(layer) or context_len) for layer in range(c.n_layers))
    return 2.0 * matmul_params(c) + 4.0 * c.n_heads * c.head_dim * keys


def attention_flops(config: ModelConfig, n_tokens: int, cached_tokens: int = 0, causal: bool = True) -> float:
    """FLOPs of q·kᵀ and pattern·v for n_tokens new queries after cached_tokens.

    causal: query i sees cached_tokens + i + 1 keys; summed over i:
        n_tokens·cached_tokens + n_tokens·(n_tokens + 1)/2 query-key pairs
    (a sliding-window layer: each query at most W keys).
    causal=False: the whole rectangle, n_tokens · (keys read), what eager attention
    multiplies before masking (keys read: :func:`kv_positions_read`).
    Each pair costs 4 · n_heads · head_dim FLOPs, in each layer.
    """
    c = config
    if causal:
        pairs = sum(_attended_pairs(n_tokens, cached_tokens, c.window(layer)) for layer in range(c.n_layers))
    else:
        pairs = n_tokens * kv_positions_read(c, n_tokens, cached_tokens)
    return 4.0 * c.n_heads * c.head_dim * pairs


def _linear_flops(config: ModelConfig, n_tokens: int, lm_head_tokens: int) -> float:
    """2 FLOPs per weight per token through the layers, and the LM head on lm_head_tokens."""
    layer_params = config.n_layers * (attention_params(config) + mlp_params(config))
    return 2.0 * (n_tokens * layer_params + lm_head_tokens * lm_head_params(config))


# -- the two phases -------------------------------------------------------------------


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
    _check(n_tokens >= 1, f"n_tokens must be >= 1, got {n_tokens}")
    _check(cached_tokens >= 0, f"cached_tokens must be >= 0, got {cached_tokens}")
    _check(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}")
    head_tokens = 1 if last_only else n_tokens
    flops = _linear_flops(config, n_tokens, head_tokens) + attention_flops(config, n_tokens, cached_tokens)
    kv = kv_bytes_per_token(config, dtype_bytes) * batch_size
    kv_read = kv // config.n_layers * kv_positions_read(config, n_tokens, cached_tokens)
    return _cost(batch_size * flops, weights_bytes(config, dtype_bytes), kv_read, kv * n_tokens)


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
    _check(context_len >= 1, f"context_len must be >= 1, got {context_len}")
    return prefill_cost(config, 1, dtype_bytes, cached_tokens=context_len - 1, batch_size=batch_size)


def with_weights_bytes(cost: PhaseCost, weights_bytes_read: float) -> PhaseCost:
    """The same cost with its weights term replaced, e.g. by ``model.weights_bytes()`` of a model
    quantised by :mod:`minillm.quantize`: its matrices are 1 or ½ byte a weight plus scales, not
    dtype_bytes (which still sizes the float KV cache). The roofline floor moves with it."""
    return _cost(cost.flops, weights_bytes_read, cost.kv_read_bytes, cost.kv_written_bytes)


def _cost(flops: float, w_bytes: float, kv_read: float, kv_written: float) -> PhaseCost:
    return PhaseCost(float(flops), float(w_bytes + kv_read + kv_written),
                     float(w_bytes), float(kv_read), float(kv_written))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
