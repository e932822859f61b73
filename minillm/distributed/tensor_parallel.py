"""Tensor parallelism: each rank holds 1/N of every layer's matrices (Megatron-LM, Shoeybi et al. 2019).

One layer on rank r of N (H query heads, Hkv K/V heads, d_mlp the MLP width)::

    x [T, d_model] (the same on every rank)
      q|k|v = x @ W_q|k|vᵀ   column-parallel: rank r holds heads r·H/N .. (r+1)·H/N - 1 and their
                            GQA group's K/V heads r·Hkv/N .. (r+1)·Hkv/N - 1, whole; its KV cache holds only those
      attention            per head, so entirely local: no communication
      o = attn @ W_oᵀ      row-parallel: W_o's input columns of those heads -> a partial sum [T, d_model]
      all-reduce(o)        <- communication 1: every rank gets the sum (+ o's bias, added once)
      gate|up              column-parallel: d_mlp/N of the MLP's units, whole
      down                 row-parallel -> partial sum
      all-reduce(down)     <- communication 2

So a layer costs two all-reduces of [T, d_model] and nothing else. The embedding is replicated: a
lookup reads T rows, so splitting it would save memory only and cost a third all-reduce per pass.
The LM head is split by vocabulary (each rank: V/N rows; tied models slice the embedding's table, no
copy), and an all-gather joins the logits [T, V/N] of every rank: the LM head is the largest matrix
of a small model (SmolLM2-135M: 28 M of 135 M parameters), so replicating it would leave a fifth of
each decode step's bytes unsplit.

Applied to a loaded float model (``load_model(..., fast=False)``: the speed layer stacks q|k|v and
swaps classes, which would undo these swaps) by :func:`shard_model`. Each Attention's
``n_heads`` / ``n_kv_heads`` and ``model.config`` then hold the local counts, so ``KVCache.for_model``
makes each rank a cache of its own heads; ``model.config.vocab_size`` stays whole (the logits are).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..model import SwiGLU, Transformer
from .comm import TensorParallelError, TensorParallelGroup, TensorParallelSizeError

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelLMHead", "check_tensor_parallel_size",
           "column_shard", "heads_of_rank", "row_shard", "shard_model", "valid_sizes", "TensorParallelError",
           "TensorParallelSizeError"]


def valid_sizes(config: ModelConfig) -> list[int]:
    """The tensor-parallel sizes N this model splits into: N divides n_heads, n_kv_heads and d_mlp."""
    limit = min(config.n_heads, config.n_kv_heads, config.d_mlp)
    return [n for n in range(1, limit + 1)
            if config.n_heads % n == 0 and config.n_kv_heads % n == 0 and config.d_mlp % n == 0]


def check_tensor_parallel_size(config: ModelConfig, world_size: int) -> None:
    """Raise TensorParallelSizeError unless ``world_size`` ranks each get whole heads and an equal MLP slice.

    Each rank must hold whole query heads and whole K/V heads with their GQA group (n_heads and
    n_kv_heads divisible by N) and an equal share of the MLP's units (d_mlp divisible by N).
    """
    if world_size < 1:
        raise TensorParallelSizeError(f"--tensor-parallel-size must be >= 1, got {world_size}")
    sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads, "d_mlp": config.d_mlp}
    bad = [f"{name} = {value}" for name, value in sizes.items() if value % world_size]
    if bad:
        raise TensorParallelSizeError(
            f"tensor-parallel size {world_size} does not divide this model's {' and '.join(bad)} (each rank "
            f"holds whole heads); valid sizes: {', '.join(map(str, valid_sizes(config)))}")


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
    n = _units_per_rank(weight.shape[0], rank, world_size, unit, "out_features (rows)")
    return weight[rank * n:(rank + 1) * n]


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
    if weight.dim() != 2:
        raise ValueError(f"row_shard splits a 2-D weight [out, in] by its columns, got shape {list(weight.shape)}")
    n = _units_per_rank(weight.shape[1], rank, world_size, unit, "in_features (columns)")
    return weight[:, rank * n:(rank + 1) * n]


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
    q = _units_per_rank(config.n_heads, rank, world_size, 1, "n_heads")
    kv = _units_per_rank(config.n_kv_heads, rank, world_size, 1, "n_kv_heads")
    return range(rank * q, (rank + 1) * q), range(rank * kv, (rank + 1) * kv)


def _units_per_rank(size: int, rank: int, world_size: int, unit: int, what: str) -> int:
    """Rows (or columns, or heads) each rank gets: size/N, after checking that whole units split N ways."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if unit < 1 or size % unit:
        raise ValueError(f"{what} = {size} is not a whole number of units of {unit}")
    if (size // unit) % world_size:
        raise ValueError(f"{size // unit} units of {unit} ({what} = {size}) do not split into {world_size} "
                         "ranks whole: a rank would hold part of a head")
    return size // world_size


class ColumnParallelLinear(nn.Linear):
    """y_r = x @ W_rᵀ (+ b_r): rank r's rows of an nn.Linear's weight [out/N, in], i.e. its slice of the outputs.

    No communication: the output [.., out/N] is this rank's heads (or MLP units), used locally.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, world_size: int, unit: int) -> "ColumnParallelLinear":
        """Rank ``rank``'s :func:`column_shard` of ``linear`` (and of its bias), ``unit`` rows kept whole."""
        bias = None if linear.bias is None else column_shard(linear.bias, rank, world_size, unit)
        return _build(cls, column_shard(linear.weight, rank, world_size, unit), bias, copy=True)


class RowParallelLinear(nn.Linear):
    """y = all-reduce(x_r @ W_rᵀ) + b: rank r's columns of the weight [out, in/N], then the sum over ranks.

    Input x_r [.., in/N]: this rank's slice of the features (its heads' attention output, its
    MLP units). Output [.., out], the same on every rank. The bias is added once, after the sum.
    """

    group: TensorParallelGroup
    name: str

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: TensorParallelGroup, name: str, unit: int) -> "RowParallelLinear":
        """Rank ``group.rank``'s :func:`row_shard` of ``linear`` (``unit`` columns kept whole), the bias whole."""
        layer = _build(cls, row_shard(linear.weight, group.rank, group.world_size, unit), linear.bias, copy=True)
        layer.group, layer.name = group, name
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        total = self.group.all_reduce(partial, self.name)
        return total if self.bias is None else total + self.bias


class VocabParallelLMHead(nn.Linear):
    """logits = all-gather(x @ W_rᵀ): rank r's ⌈V/N⌉ rows of the LM head [V, d_model] (the last rank's
    padded with zero rows when N does not divide V), gathered and cut back to [.., V] on every rank."""

    group: TensorParallelGroup
    vocab_size: int

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: TensorParallelGroup, tied: bool) -> "VocabParallelLMHead":
        vocab = linear.out_features
        n = -(-vocab // group.world_size)
        rows = linear.weight[group.rank * n:(group.rank + 1) * n]
        head = _build(cls, rows, None, copy=not tied)  # tied: a view, the embedding's own rows
        head.group, head.vocab_size, head.rows_per_rank = group, vocab, n
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)
        if local.shape[-1] < self.rows_per_rank:  # the last rank of an uneven split
            local = F.pad(local, (0, self.rows_per_rank - local.shape[-1]))
        return self.group.all_gather_last_dim(local, "lm_head")[..., :self.vocab_size]


def shard_model(model: Transformer, group: TensorParallelGroup) -> Transformer:
    """Keep only this rank's 1/N of ``model``'s matrices (see the module docstring); in place, returned.

    ``model``: a float model loaded with ``fast=False``, the same checkpoint on every rank.
    Afterwards ``model.config`` holds the local n_heads, n_kv_heads and d_mlp, and
    ``model.tensor_parallel`` the group. Raises TensorParallelSizeError when the sizes do not
    split (:func:`check_tensor_parallel_size`), ValueError for a quantised or already-fast model.
    """
    config, N, r = model.config, group.world_size, group.rank
    check_tensor_parallel_size(config, N)
    if getattr(model, "decode_path", None) is not None or any(type(m) not in (nn.Linear,) for m in _linears(model)):
        raise ValueError("tensor parallelism splits the lesson's float nn.Linear layers: load the model with "
                         "load_model(..., fast=False) and without quantize")
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), r, N, config.head_dim))
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, group, f"blocks.{i}.attn.o_proj", config.head_dim)
        attn.n_heads, attn.n_kv_heads = config.n_heads // N, config.n_kv_heads // N
        columns = ("gate_proj", "up_proj") if isinstance(mlp, SwiGLU) else ("up_proj",)  # GPT2MLP: up only
        for name in columns:
            setattr(mlp, name, ColumnParallelLinear.from_linear(getattr(mlp, name), r, N, 1))
        mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, group, f"blocks.{i}.mlp.down_proj", 1)
    tied = model.lm_head.weight is model.embed.weight
    model.lm_head = VocabParallelLMHead.from_linear(model.lm_head, group, tied)
    model.config = replace(config, n_heads=config.n_heads // N, n_kv_heads=config.n_kv_heads // N,
                           d_mlp=config.d_mlp // N)
    model.tensor_parallel = group
    return model


def _linears(model: Transformer) -> list[nn.Module]:
    """The modules shard_model replaces (a quantised or fast layer would be another class)."""
    out = [model.lm_head]
    for block in model.blocks:
        out += [block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.attn.o_proj, block.mlp.down_proj,
                block.mlp.up_proj] + ([block.mlp.gate_proj] if isinstance(block.mlp, SwiGLU) else [])
    return out


def _build(cls, weight: torch.Tensor, bias: torch.Tensor | None, copy: bool) -> nn.Linear:
    """An instance of ``cls`` (an nn.Linear subclass) over ``weight`` [out, in] and ``bias``. ``copy``: the
    slice gets memory of its own, so the whole matrix is freed once every layer is swapped."""
    with torch.device("meta"):
        layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
    weight = weight.clone(memory_format=torch.contiguous_format) if copy else weight
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)
    return layer
