"""Exercise 21: tensor parallelism, where each rank's shards come from and what crosses the link.

Write, for rank ``rank`` of ``world_size`` (N) ranks sharing one model the Megatron way:

- ``column_shard(weight, rank, world_size, unit)``: the block of whole output rows a
  column-parallel layer (q, k, v, gate, up) keeps; ``unit`` rows stay together (a head);
- ``row_shard(weight, rank, world_size, unit)``: the block of whole input columns a row-parallel
  layer (o, down) keeps;
- ``heads_of_rank(config, rank, world_size)``: the query heads and the K/V heads (GQA) it holds;
- ``all_reduce_bytes_per_layer(config, n_tokens, world_size, dtype_bytes)``: the bytes each rank
  sends over a ring all-reduce in one layer.

The checks split tiny layers with your shards and add the ranks' partial outputs: the sum must
be the unsplit layer's output. Plain slicing is enough (return views; no copies needed).

Check:      minillm check ex21   (or: pytest tests/exercises -m ex21 --impl student)
Lesson:     lessons/12-tensor-parallelism.md#the-megatron-split-of-one-layer
            lessons/12-tensor-parallelism.md#the-communication-per-layer
Reference:  minillm.distributed.tensor_parallel.column_shard, .row_shard, .heads_of_rank,
            minillm.costs.all_reduce_bytes_per_layer (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import torch

from minillm.config import ModelConfig


def column_shard(weight: torch.Tensor, rank: int, world_size: int, unit: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of a column-parallel layer's weight: its block of whole output rows (a view).

        weight [out, in] -> weight[r·out/N : (r+1)·out/N]     [out/N, in]     (a bias [out] -> [out/N])

    A column-parallel layer (q, k, v, gate, up) splits its outputs: rank r computes out/N of them
    from the whole input. Rows come in units that must stay whole: ``head_dim`` rows are one head
    of q_proj, k_proj or v_proj (attention is per head, so a rank must hold all of a head's
    dimensions), one row is one unit of the MLP. So out/unit units are split N ways, in order:
    rank r holds units r·U/N .. (r+1)·U/N - 1 (U = out/unit). Megatron-LM (Shoeybi et al. 2019),
    section 3; :class:`ColumnParallelLinear` is this slice, copied.

    Args:
        weight: an nn.Linear's weight [out_features, in_features] (or its bias [out_features]), any dtype.
        rank: r, 0 <= r < world_size.
        world_size: N >= 1.
        unit: rows that stay together, >= 1 (head_dim for q/k/v, 1 for gate/up).

    Returns a view of ``weight``: [out/N, in] (or [out/N]).
    Raises ValueError for world_size < 1, rank outside [0, world_size), unit < 1, out_features not a
    multiple of unit, or a number of units (heads) that N does not divide.
    """
    raise NotImplementedError(
        "Exercise 21 (tensor parallelism) is not written yet: see lessons/12-tensor-parallelism.md#the-megatron-split-of-one-layer"
    )


def row_shard(weight: torch.Tensor, rank: int, world_size: int, unit: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of a row-parallel layer's weight: its block of whole input columns (a view).

        weight [out, in] -> weight[:, r·in/N : (r+1)·in/N]     [out, in/N]

    A row-parallel layer (o_proj, down_proj) splits its inputs: rank r holds the columns that read
    the features it computed (its heads' attention outputs, ``head_dim`` columns a head; its MLP
    units, one column each), so x_r @ W_rᵀ is a partial sum [.., out] and an all-reduce adds the N
    of them. Its bias is not split: it is added once, after the sum. The columns must match the
    column-parallel layer before it: rank r's units r·U/N .. (r+1)·U/N - 1 (U = in/unit).
    Megatron-LM (Shoeybi et al. 2019), section 3; :class:`RowParallelLinear` is this slice, copied.

    Args:
        weight: an nn.Linear's weight [out_features, in_features], any dtype (2-D).
        rank: r, 0 <= r < world_size.
        world_size: N >= 1.
        unit: columns that stay together, >= 1 (head_dim for o_proj, 1 for down_proj).

    Returns a view of ``weight``: [out, in/N].
    Raises ValueError for a weight that is not 2-D, world_size < 1, rank outside [0, world_size),
    unit < 1, in_features not a multiple of unit, or a number of units (heads) that N does not divide.
    """
    raise NotImplementedError(
        "Exercise 21 (tensor parallelism) is not written yet: see lessons/12-tensor-parallelism.md#the-megatron-split-of-one-layer"
    )


def heads_of_rank(config: ModelConfig, rank: int, world_size: int) -> tuple[range, range]:
    """The query heads and the K/V heads rank ``rank`` of ``world_size`` holds (and caches).

        query heads  r·H/N   .. (r+1)·H/N - 1        H = n_heads
        K/V heads    r·Hkv/N .. (r+1)·Hkv/N - 1      Hkv = n_kv_heads

    Contiguous blocks, as :func:`column_shard` cuts q_proj and k_proj/v_proj. With GQA, query head h
    reads K/V head h // (H/Hkv); rank r's query heads all read K/V heads of its own block, so
    attention needs no communication, and each rank's KV cache holds only its Hkv/N heads.

    Args:
        config: the model; only n_heads and n_kv_heads matter.
        rank: r, 0 <= r < world_size.
        world_size: N >= 1, dividing n_heads and n_kv_heads (each rank holds whole heads).

    Returns (query heads, K/V heads), two ranges of head indices.
    Raises ValueError for world_size < 1, rank outside [0, world_size), or N not dividing n_heads
    or n_kv_heads.
    """
    raise NotImplementedError(
        "Exercise 21 (tensor parallelism) is not written yet: see lessons/12-tensor-parallelism.md#the-megatron-split-of-one-layer"
    )


def all_reduce_bytes_per_layer(config: ModelConfig, n_tokens: int, world_size: int,
                               dtype_bytes: int) -> float:
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
    raise NotImplementedError(
        "Exercise 21 (tensor parallelism) is not written yet: see lessons/12-tensor-parallelism.md#the-communication-per-layer"
    )
