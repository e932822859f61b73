"""One decoder-only transformer for GPT-2, Llama, Mistral, Qwen2 and Qwen3, built from small swappable parts.

    token ids [B, T]
      -> embed (+ learned pos_embed for GPT-2)          x: [B, T, d_model]
      -> n_layers × Block:
             x = x + Attention(ln1(x))   (q, k, v projections; Qwen3: RMSNorm on each q and k head;
                                          RoPE on q, k for all but GPT-2; K/V go to the KV cache)
             x = x + MLP(ln2(x))         (GELU MLP for GPT-2, SwiGLU for the others)
      -> ln_final -> lm_head                              logits: [B, T, vocab]

| family         | positions         | norm               | MLP                      | attention                    | biases             |
|----------------|-------------------|--------------------|--------------------------|------------------------------|--------------------|
| GPT-2          | learned pos_embed | LayerNorm          | up -> GELU(tanh) -> down | n_kv_heads = n_heads         | everywhere         |
| Llama, Mistral | RoPE on q and k   | RMSNorm            | down(silu(gate) * up)    | grouped-query (GQA)          | none (Llama: opt.) |
| Qwen2, Qwen2.5 | RoPE on q and k   | RMSNorm            | down(silu(gate) * up)    | GQA                          | q, k, v (not o)    |
| Qwen3          | RoPE on q and k   | RMSNorm + QK-norm  | down(silu(gate) * up)    | GQA, head_dim of its own     | none (opt.: all 4) |

Attention scores are scaled by 1/√head_dim (GPT-2's flags may drop it or divide by layer + 1).
Mistral's ``sliding_window`` W: each query of a window layer sees only the last W keys.

Per-layer activations can be observed through ``hook(name, tensor)``; the names follow
TransformerLens (``blocks.3.attn.hook_q``, ...). With ``hook=None`` nothing is recorded.

This file is the lesson: plain PyTorch, one forward loop. A faster layout of the same weights
(stacked products, C kernels, a compiled decode step) is swapped in from outside, module by
module, by :mod:`minillm.fast`; ``load_model(..., fast=False)`` runs exactly this code.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import RotaryEmbedding, apply_rope

Hook = Callable[[str, torch.Tensor], None]
ATTN_IMPLS = ("sdpa", "eager")


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight (Zhang & Sennrich 2019), computed in float32 as HF Llama does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) · weight + bias (Ba et al. 2016), GPT-2's norm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def make_norm(config: ModelConfig) -> nn.Module:
    cls = RMSNorm if config.uses_rope else LayerNorm
    return cls(config.d_model, config.norm_eps)


# ModelConfig.activation -> the function (transformers' ACT2FN names are mapped in config.py).
ACTIVATIONS = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


class GPT2MLP(nn.Module):
    """GPT-2's MLP: down(act(up(x))), d_model -> d_mlp -> d_model; act is GELU(tanh) by default."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, config.d_mlp, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.d_mlp, config.d_model, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class SwiGLU(nn.Module):
    """Llama's MLP (Shazeer 2020, "GLU Variants"): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_mlp, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.d_model, config.d_mlp, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.d_mlp, config.d_model, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def causal_mask(n_queries: int, n_keys: int, device=None, window: int | None = None) -> torch.Tensor:
    """Which keys each query may attend to, [n_queries, n_keys] bool.

    The queries are the *last* n_queries positions of the n_keys (the earlier keys
    come from the KV cache). Query i sits at position n_keys - n_queries + i and sees
    keys 0..that position:

        n_queries=2, n_keys=5:   1 1 1 1 0
                                 1 1 1 1 1

    With a sliding ``window`` W, it sees only the last W of them, keys j with
    position - W < j <= position (transformers' ``sliding_window_overlay`` and causal mask):

        n_queries=4, n_keys=4, window=2:   1 0 0 0
                                           1 1 0 0
                                           0 1 1 0
                                           0 0 1 1
    """
    mask = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n_queries)
    if window is not None:
        mask = mask.triu(diagonal=n_keys - n_queries - window + 1)
    return mask


def eager_attention(q, k, v, hook: Hook | None = None, name: str = "", scale: float | None = None,
                    window: int | None = None) -> torch.Tensor:
    """softmax(q·kᵀ / √head_dim + causal mask) · v, written out (Vaswani et al. 2017).

    ``scale`` replaces 1/√head_dim when given (see ``ModelConfig.attn_scale``); ``window``
    makes the mask a sliding window (:func:`causal_mask`).

    q: [B, n_heads, T, head_dim]; k, v: [B, n_kv_heads, S, head_dim] with S >= T.
    Grouped-query attention: each K/V head serves n_heads / n_kv_heads query heads,
    so q is viewed as [B, n_kv_heads, n_rep, T, head_dim] and k, v broadcast over n_rep.
    Returns [B, n_heads, T, head_dim].
    """
    B, n_heads, T, head_dim = q.shape
    n_kv_heads, S = k.shape[1], k.shape[2]
    q = q.view(B, n_kv_heads, n_heads // n_kv_heads, T, head_dim)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    scores = q @ k.unsqueeze(2).transpose(-1, -2) * scale  # [B, kv, rep, T, S]
    scores = scores.masked_fill(~causal_mask(T, S, q.device, window), float("-inf"))
    pattern = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if hook:
        hook(f"{name}.hook_pattern", pattern.view(B, n_heads, T, S))
    return (pattern @ v.unsqueeze(2)).view(B, n_heads, T, head_dim)


def sdpa_attention(q, k, v, mask: torch.Tensor | None = None, scale: float | None = None,
                   window: int | None = None) -> torch.Tensor:
    """The same attention through ``F.scaled_dot_product_attention`` (fused kernels).

    ``scale`` and ``window`` as in ``eager_attention``.

    One new query (decode) sees every key (or, with a window, every key when there are at
    most W): no mask. A square prefill from an empty cache is plain causal (while no query
    is more than W - 1 positions past the first key). Otherwise (a suffix prefilled onto a
    filled cache, a window that cuts) the explicit mask. ``mask`` (bool, True = may attend)
    overrides all that: a cache that hands over more keys than a query may see (a static
    buffer, a serving batch's padded blocks) masks them itself.
    """
    T, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    if T == 1 and (window is None or S <= window):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, scale=scale)
    if T == S and (window is None or S <= window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    mask = causal_mask(T, S, q.device, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query K/V heads and an optional KV cache.

    The cache is any object with ``attend(layer, q, k, v, attention, window)``: it stores this
    pass's k, v and returns ``attention(q, keys, values, mask)`` over the keys the queries may read
    (:meth:`minillm.kv_cache.KVCache.attend`; a serving batch reads each request's own blocks and
    builds its masks, sliding ``window`` included).
    """

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.layer, self.name = layer, f"blocks.{layer}.attn"
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.scale = c.attn_scale(layer)  # 1/√head_dim unless the config says otherwise (GPT-2 flags)
        self.window = c.window(layer)  # W: sliding-window attention (Mistral), None: full
        self.q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=c.o_bias)
        # Qwen3's QK-norm: one RMSNorm over head_dim, shared by every head of q (and of k).
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d_model] -> q [B, T, H·D], k and v [B, T, Hkv·D]."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope_cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE: q [B, H, T, D] and k [B, Hkv, T, D] rotated by their positions' angles (cos, sin [T, D])."""
        cos, sin = rope_cos_sin
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(self, q, k, v, mask: torch.Tensor | None, impl: str, hook: Hook | None) -> torch.Tensor:
        """Attention of q [B, H, T, D] over the keys and values k, v [B, Hkv, S, D] a cache returned.

        ``mask`` None: the queries are the last T of the S positions, masked causally (and by the
        sliding window); else the cache's own mask, which SDPA applies (eager attention writes out
        the causal case only). Returns [B, H, T, D].
        """
        if self.window is not None and mask is None:
            # The first query sees back to W - 1 positions before itself: older keys are not read.
            k, v = k[:, :, -(q.shape[2] + self.window - 1):], v[:, :, -(q.shape[2] + self.window - 1):]
        if impl == "eager" and mask is None:
            return eager_attention(q, k, v, hook, self.name, self.scale, self.window)
        return sdpa_attention(q, k, v, mask, self.scale, self.window)

    def impl_name(self, n_queries: int, impl: str, n_keys: int | None = None) -> str:
        """The attention implementation a pass of ``n_queries`` queries over ``n_keys`` positions (None:
        as many as queries) runs: what a trace records."""
        return impl

    def forward(self, x, rope_cos_sin, cache, impl: str, hook: Hook | None) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]; writes this layer's new K/V into ``cache``."""
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # QK-norm: bounded q·k scores whatever the weights' scale, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if hook:
            for part, t in (("q", q), ("k", k), ("v", v)):
                hook(f"{self.name}.hook_{part}", t)
        if rope_cos_sin is not None:
            q, k = self.rotate(q, k, rope_cos_sin)

        def attention(q, keys, values, mask):  # over every position the cache holds for these queries
            if hook and cache is not None:
                hook(f"{self.name}.hook_k_cache", keys)
                hook(f"{self.name}.hook_v_cache", values)
            return self.attend(q, keys, values, mask, impl, hook)

        out = attention(q, k, v, None) if cache is None else cache.attend(self.layer, q, k, v, attention, self.window)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class Block(nn.Module):
    """One pre-norm transformer layer: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.name = f"blocks.{layer}"
        self.ln1 = make_norm(config)
        self.attn = Attention(config, layer)
        self.ln2 = make_norm(config)
        self.mlp = SwiGLU(config) if config.gated_mlp else GPT2MLP(config)

    def forward(self, x, rope_cos_sin, cache, impl, hook):
        attn_out = self.attn(self.ln1(x), rope_cos_sin, cache, impl, hook)
        x = x + attn_out
        mlp_out = self.mlp(self.ln2(x))
        if hook:
            hook(f"{self.name}.hook_attn_out", attn_out)
            hook(f"{self.name}.hook_mlp_out", mlp_out)
        x = x + mlp_out
        if hook:
            hook(f"{self.name}.hook_resid_post", x)
        return x


class Transformer(nn.Module):
    """A decoder-only language model for GPT-2 and Llama-family configs.

    Build it with :func:`minillm.load_model`, which fills every weight from a checkpoint.

    Attributes:
        config: the :class:`ModelConfig`.
        attn_impl: "sdpa" (default, fused kernel) or "eager" (the math written out);
            both give the same logits.
    """

    def __init__(self, config: ModelConfig, attn_impl: str = "sdpa"):
        super().__init__()
        self.config = config
        self.attn_impl = attn_impl
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_embed = None if config.uses_rope else nn.Embedding(config.max_seq_len, config.d_model)
        self.rope = RotaryEmbedding(config) if config.uses_rope else None
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.ln_final = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def attn_impl(self) -> str:
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, value: str) -> None:
        if value not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {', '.join(ATTN_IMPLS)}, got {value!r}")
        self._attn_impl = value

    def forward(self, token_ids: torch.Tensor, cache=None, hook: Hook | None = None, last_only: bool = False,
                positions: torch.Tensor | None = None, logits_rows=None) -> torch.Tensor:
        """Run the model over token_ids [B, T] (int64): the one loop over the layers.

        Without a cache: the reference full-sequence pass from position 0.
        With a cache (:class:`~minillm.kv_cache.KVCache`): positions start at ``cache.length``; each layer writes
        its new K/V there and attends over the whole filled cache (a sliding-window layer: the
        positions its window still sees); ``cache.length`` then grows by T.
        With ``positions`` ([T] int64, each token's position): the caller keeps the cache's
        length (the compiled decode step of :mod:`minillm.fast`, a serving batch whose requests
        sit at different positions).

        Returns logits [B, T, vocab] in the model's dtype; [B, 1, vocab] with ``last_only``
        (prefill needs only the last position: the LM head is the largest matmul); the rows
        ``logits_rows`` (an index of T) only, when given.
        Raises ValueError when the positions would pass the model's context.
        """
        T = token_ids.shape[1]
        advance = cache is not None and positions is None
        if positions is None:
            start = cache.length if cache is not None else 0
            if start + T > self.config.max_seq_len:
                raise ValueError(f"{start + T} positions exceed the model's context of "
                                 f"{self.config.max_seq_len}; shorten the input")
            positions = torch.arange(start, start + T, device=token_ids.device)
        x = self.embed(token_ids)
        if hook:
            hook("hook_embed", x)
        if self.pos_embed is not None:
            pos = self.pos_embed(positions)
            if hook:
                hook("hook_pos_embed", pos)
            x = x + pos
        rope_cos_sin = self.rope(positions, x.dtype) if self.rope is not None else None
        for block in self.blocks:
            x = block(x, rope_cos_sin, cache, self.attn_impl, hook)
        if advance:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        elif logits_rows is not None:
            x = x[:, logits_rows]
        x = self.ln_final(x)
        if hook:
            hook("ln_final.hook_normalized", x)
        return self.lm_head(x)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied LM head is counted once). A module that stores its weights
        in another form (a quantised matrix, :mod:`minillm.quantize`) counts the weights it
        stands for, through its own ``num_parameters()``."""
        n = sum(p.numel() for p in self.parameters())
        n += sum(m.num_parameters() for m in self._self_sized())
        if self._head_is_a_copy():  # the copy stands for the embedding's weights, counted already
            n -= self.embed.weight.numel()
        return n

    def weights_bytes(self) -> int:
        """Bytes of all distinct parameters, i.e. what one decode step must read.

        A module that stores its weights in another form answers for itself through its own
        ``weights_bytes()`` (a quantised matrix: codes, scales and zeros). A tied LM head that was
        replaced by such a copy reads the copy, while the lookup reads one row of the float
        embedding: the copy is counted, the float table is not (it is memory, not traffic).
        """
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        own = sum(m.weights_bytes() for m in self._self_sized())
        if self._head_is_a_copy():
            params -= self.embed.weight.numel() * self.embed.weight.element_size()
        return params + own

    def _self_sized(self) -> list[nn.Module]:
        return [m for m in self.modules() if m is not self and hasattr(m, "weights_bytes")]

    def _head_is_a_copy(self) -> bool:
        """A tied LM head that no longer shares the embedding's table (a quantised copy of it)."""
        return self.config.tie_word_embeddings and getattr(self.lm_head, "weight", None) is not self.embed.weight
