"""One decoder-only transformer for both GPT-2 and Llama, built from small swappable parts.

    token ids [B, T]
      -> embed (+ learned pos_embed for GPT-2)          x: [B, T, d_model]
      -> n_layers × Block:
             x = x + Attention(ln1(x))   (RoPE on q, k for Llama; K/V go to the KV cache)
             x = x + MLP(ln2(x))         (GELU MLP for GPT-2, SwiGLU for Llama)
      -> ln_final -> lm_head                              logits: [B, T, vocab]

| part      | GPT-2                    | Llama / Mistral              |
|-----------|--------------------------|------------------------------|
| positions | learned ``pos_embed``    | rotary (RoPE) on q and k     |
| norm      | LayerNorm (with bias)    | RMSNorm                      |
| MLP       | up -> GELU(tanh) -> down | down(silu(gate) * up)        |
| attention | n_kv_heads = n_heads     | grouped-query (n_kv_heads <= n_heads) |

Per-layer activations can be observed through ``hook(name, tensor)``; the names follow
TransformerLens (``blocks.3.attn.hook_q``, ...). With ``hook=None`` nothing is recorded.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache
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


class GeluMLP(nn.Module):
    """GPT-2's MLP: down(gelu_tanh(up(x))), d_model -> d_mlp -> d_model."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, config.d_mlp, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.d_mlp, config.d_model, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """Llama's MLP (Shazeer 2020, "GLU Variants"): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_mlp, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.d_model, config.d_mlp, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.d_mlp, config.d_model, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def causal_mask(n_queries: int, n_keys: int, device=None) -> torch.Tensor:
    """Which keys each query may attend to, [n_queries, n_keys] bool.

    The queries are the *last* n_queries positions of the n_keys (the earlier keys
    come from the KV cache). Query i sits at position n_keys - n_queries + i and sees
    keys 0..that position:

        n_queries=2, n_keys=5:   1 1 1 1 0
                                 1 1 1 1 1
    """
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n_queries)


def eager_attention(q, k, v, hook: Hook | None = None, name: str = "") -> torch.Tensor:
    """softmax(q·kᵀ / √head_dim + causal mask) · v, written out (Vaswani et al. 2017).

    q: [B, n_heads, T, head_dim]; k, v: [B, n_kv_heads, S, head_dim] with S >= T.
    Grouped-query attention: each K/V head serves n_heads / n_kv_heads query heads,
    so q is viewed as [B, n_kv_heads, n_rep, T, head_dim] and k, v broadcast over n_rep.
    Returns [B, n_heads, T, head_dim].
    """
    B, n_heads, T, head_dim = q.shape
    n_kv_heads, S = k.shape[1], k.shape[2]
    q = q.view(B, n_kv_heads, n_heads // n_kv_heads, T, head_dim)
    scores = q @ k.unsqueeze(2).transpose(-1, -2) / math.sqrt(head_dim)  # [B, kv, rep, T, S]
    scores = scores.masked_fill(~causal_mask(T, S, q.device), float("-inf"))
    pattern = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if hook:
        hook(f"{name}.hook_pattern", pattern.view(B, n_heads, T, S))
    return (pattern @ v.unsqueeze(2)).view(B, n_heads, T, head_dim)


def sdpa_attention(q, k, v) -> torch.Tensor:
    """The same attention through ``F.scaled_dot_product_attention`` (fused kernels).

    One new query (decode) sees every key: no mask. A square prefill from an empty
    cache is plain causal. A suffix prefilled onto a filled cache needs the explicit
    rectangular mask.
    """
    T, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if T == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(T, S, q.device), enable_gqa=gqa)


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query K/V heads and an optional KV cache."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.layer, self.name = layer, f"blocks.{layer}.attn"
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=c.attention_bias)

    def forward(self, x, rope_cos_sin, cache: KVCache | None, impl: str, hook: Hook | None) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]; writes this layer's new K/V into ``cache``."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if hook:
            for part, t in (("q", q), ("k", k), ("v", v)):
                hook(f"{self.name}.hook_{part}", t)
        if rope_cos_sin is not None:
            q, k = apply_rope(q, *rope_cos_sin), apply_rope(k, *rope_cos_sin)
        if cache is not None:
            k, v = cache.write(self.layer, k, v)  # now every position so far: [B, Hkv, S, D]
            if hook:
                hook(f"{self.name}.hook_k_cache", k)
                hook(f"{self.name}.hook_v_cache", v)
        if impl == "eager":
            out = eager_attention(q, k, v, hook, self.name)
        else:
            out = sdpa_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class Block(nn.Module):
    """One pre-norm transformer layer: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.name = f"blocks.{layer}"
        self.ln1 = make_norm(config)
        self.attn = Attention(config, layer)
        self.ln2 = make_norm(config)
        self.mlp = SwiGLU(config) if config.activation == "silu" else GeluMLP(config)

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

    def forward(
        self,
        token_ids: torch.Tensor,
        cache: KVCache | None = None,
        hook: Hook | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run the model over token_ids [B, T] (int64).

        Without a cache: the reference full-sequence pass from position 0.
        With a cache: positions start at ``cache.length``; each layer writes its new
        K/V there and attends over the whole filled cache; ``cache.length`` then grows by T.

        Returns logits [B, T, vocab] in the model's dtype, or [B, 1, vocab] with ``last_only``
        (prefill needs only the last position: the LM head is the largest matmul).
        """
        start = cache.length if cache is not None else 0
        T = token_ids.shape[1]
        if start + T > self.config.max_seq_len:
            raise ValueError(
                f"{start + T} positions exceed the model's context of {self.config.max_seq_len}; shorten the input"
            )
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
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]
        x = self.ln_final(x)
        if hook:
            hook("ln_final.hook_normalized", x)
        return self.lm_head(x)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied LM head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def weights_bytes(self) -> int:
        """Bytes of all distinct parameters, i.e. what one decode step must read."""
        return sum(p.numel() * p.element_size() for p in self.parameters())
