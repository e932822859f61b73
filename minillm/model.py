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
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import matvec_kernels
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


SPLIT_MAX_ROWS = 64  # decode rows (one per sequence); above, MKL's own threading of a product wins
MATVEC_MAX_ROWS = 16  # a decode step's or a speculative verify pass's rows; above, MKL's blocked product wins
PRODUCTS = ("linear", "split", "matvec")
_products = "split"  # process-wide, like torch.set_num_threads; minillm.decode_path sets it per machine


def use_products(name: str) -> None:
    """How :func:`linear` multiplies a few float32 rows on a CPU, for this process (default "split").

    "linear": ``F.linear``; "split": the matrix cut into a block per thread; "matvec": the C
    kernel of :mod:`minillm.matvec_kernels`. :mod:`minillm.decode_path` measures them on each
    machine and keeps the fastest. Raises ValueError for another name.
    """
    global _products
    if name not in PRODUCTS:
        raise ValueError(f"{name!r} is not a product; use one of {', '.join(PRODUCTS)}")
    _products = name


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weightᵀ + bias, as ``F.linear``: x [..., in], weight [out, in] -> [..., out].

    A decode step multiplies one row per sequence by every matrix: the time goes into
    reading the matrix from memory, and MKL reads it with one CPU core, which cannot
    stream memory as fast as all the cores together. Two ways around it, for CPU float32:

    - "split": a product of at most SPLIT_MAX_ROWS rows is cut into n column blocks of the
      matrix (n threads), run as one batched matmul (a block per thread):

          x @ Wᵀ  =  [ x @ Wᵀ[:, block 0] | x @ Wᵀ[:, block 1] | ... ]      (views, no copies)

      On 2 cores this took a SmolLM2-135M decode step from 43.1 to 36.2 ms at batch 1 and
      from 103 to 71 ms at batch 8 (BENCHMARKS.md). Up to 64 rows (a serving engine's batch
      of decodes) MKL threads a small-row product poorly too: a step of 30 decodes on the
      paged engine took 271 -> 222 ms (fastest of 8, 2 threads).
    - "matvec": up to MATVEC_MAX_ROWS rows, a C loop (:mod:`minillm.matvec_kernels`) gives each
      thread a share of the matrix's rows and reads each weight once for all of x's rows; it is
      also an op a ``torch.compile``'d step calls (inductor's own code for the product is slower).
      Row-major weights only.

    Prefill's many rows, a GPU and 16-bit floats use ``F.linear``: MKL already spreads a big
    product over every core, cuBLAS a product over the GPU, and CPU bmm is slower than F.linear
    in bfloat16 and float16 (measured); so does a compiled step on "split" (inductor turns the
    batched product into a slower kernel). Which one wins differs between CPUs (on an Intel
    Xeon with AVX-512 plain F.linear was as fast as split, issue 16), so :mod:`minillm.decode_path`
    measures them and :func:`use_products` sets the winner. Same values as ``F.linear`` up to
    float rounding.
    """
    if (_products == "linear" or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != x.dtype
            or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or x.shape[-1] == 0
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)  # (and F.linear's own errors for a bad dtype or shape; autograd)
    rows = x.numel() // x.shape[-1]
    if _products == "matvec" and 0 < rows <= MATVEC_MAX_ROWS and weight.is_contiguous() and matvec_kernels.available():
        y = matvec_kernels.functions().f32_matvec(x.reshape(rows, -1), weight).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    if _products != "split" or torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    n, out = torch.get_num_threads(), weight.shape[0]
    if n == 1 or out % n or not 0 < rows <= SPLIT_MAX_ROWS:
        return F.linear(x, weight, bias)
    blocks = weight.t().unflatten(1, (n, out // n)).transpose(0, 1)  # [n, in, out/n]
    y = torch.bmm(x.reshape(1, rows, -1).expand(n, -1, -1), blocks)  # [n, rows, out/n]
    y = y.transpose(0, 1).reshape(*x.shape[:-1], out)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _pack(linears: list[nn.Linear], long_rows: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the weights (and biases) of linears sharing one input into one [sum(out), in] matrix.

    Each linear's weight becomes a view of its rows, so names, shapes and values stay.
    With ``long_rows``, the matrix is stored so that its contiguous runs are along its
    longer side: transposed in memory (strides (1, out), "column-major") when out >= in.
    Allocated once and copied into (no temporary copies). Returns (weight, bias or None).
    """
    first = linears[0].weight
    shape = (sum(lin.out_features for lin in linears), first.shape[1])
    if long_rows and shape[0] >= shape[1]:
        weight = torch.empty(shape[::-1], dtype=first.dtype, device=first.device).t()
    else:
        weight = torch.empty(shape, dtype=first.dtype, device=first.device)
    bias = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
    start = 0
    for lin in linears:
        end = start + lin.out_features
        weight[start:end].copy_(lin.weight)
        lin.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


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
        self.up_proj = Linear(config.d_model, config.d_mlp, bias=config.mlp_bias)
        self.down_proj = Linear(config.d_mlp, config.d_model, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class SwiGLU(nn.Module):
    """Llama's MLP (Shazeer 2020, "GLU Variants"): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(config.d_model, config.d_mlp, bias=config.mlp_bias)
        self.up_proj = Linear(config.d_model, config.d_mlp, bias=config.mlp_bias)
        self.down_proj = Linear(config.d_mlp, config.d_model, bias=config.mlp_bias)
        # [2·d_mlp, d_model]: gate and up stacked, set by Transformer.pack_weights (one matmul, not two);
        # a quantised model (minillm.quantize) stacks them into one quantised matrix instead.
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.register_buffer("gate_up_bias", None, persistent=False)
        self.register_module("gate_up_proj", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        elif self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


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
    filled cache, a window that cuts) the explicit mask. ``mask`` [T, S] bool (True = may
    attend) overrides all that: a static cache (:mod:`minillm.compile`) hands over its whole
    buffer and masks the unfilled end.
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


def decode_attention_in_c(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether attention runs :func:`minillm.matvec_kernels.decode_attention` (flash-decoding's split
    of the keys, in C) instead of SDPA: on the "matvec" decode paths (:func:`use_products`), for one
    float32 CPU query a sequence (T = 1) over a cache with contiguous rows, head_dim a multiple of 8.

    Why: decode's attention reads each layer's K and V once for a few FLOPs a byte, and SDPA's CPU
    kernel spends its time elsewhere: a compiled SmolLM2-135M float32 step on the developers' 2-core
    EPYC took 40.0-42.6 ms with the C loop against 44.3-44.7 ms with SDPA at 128 positions, and
    45.8-50.7 against 52.8-59.1 ms at 1,000 (BENCHMARKS.md). Compiled code takes it over a static
    view only (its position is a tensor the op reads). Same values as SDPA up to float rounding.
    """
    return (q.shape[2] == 1 and attention_in_c(q.dtype, q.device, q.shape[-1]) and k.dtype == q.dtype
            and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1] and not (torch.is_grad_enabled() and q.requires_grad)
            and (mask is not None or not torch.compiler.is_compiling()))


def attention_in_c(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a decode step of a model with this dtype, device and head_dim runs its attention in C
    (:func:`decode_attention_in_c` without the tensors: what a trace labels its decode passes)."""
    return (_products == "matvec" and torch.device(device).type == "cpu" and dtype == torch.float32
            and head_dim % 8 == 0 and matvec_kernels.available())


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query K/V heads and an optional KV cache."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        self.layer, self.name = layer, f"blocks.{layer}.attn"
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.scale = c.attn_scale(layer)  # 1/√head_dim unless the config says otherwise (GPT-2 flags)
        self.window = c.window(layer)  # W: sliding-window attention (Mistral), None: full
        self.q_proj = Linear(c.d_model, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = Linear(c.n_heads * c.head_dim, c.d_model, bias=c.o_bias)
        # Qwen3's QK-norm: one RMSNorm over head_dim, shared by every head of q (and of k).
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        # [(H + 2·Hkv)·D, d_model]: q, k, v stacked, set by Transformer.pack_weights (one matmul, not three);
        # a quantised model (minillm.quantize) stacks them into one quantised matrix instead.
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_module("qkv_proj", None)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d_model] -> q [B, T, H·D], k and v [B, T, Hkv·D]: one product of the stacked
        matrix when there is one (packed float weights, or a quantised model's), else three."""
        if self.qkv_proj is None and self.qkv_weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = self.qkv_proj(x) if self.qkv_proj is not None else linear(x, self.qkv_weight, self.qkv_bias)
        sizes = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim)
        return qkv.split(sizes, dim=-1)

    def forward(self, x, rope_cos_sin, cache: KVCache | None, impl: str, hook: Hook | None) -> torch.Tensor:
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
            q, k = apply_rope(q, *rope_cos_sin), apply_rope(k, *rope_cos_sin)
        if getattr(cache, "paged", False):  # a serving batch (minillm/serving): each request reads its own blocks
            out = cache.attend(self.layer, q, k, v, self.scale, self.window)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        if cache is not None:
            k, v = cache.write(self.layer, k, v)  # all positions so far (rolling: what the window needs)
            if hook:
                hook(f"{self.name}.hook_k_cache", k)
                hook(f"{self.name}.hook_v_cache", v)
        mask = cache.attn_mask if cache is not None else None
        if self.window is not None and mask is None:
            # The first query sees back to W - 1 positions before itself: older keys are not read.
            k, v = k[:, :, -(T + self.window - 1):], v[:, :, -(T + self.window - 1):]
        if impl == "eager":
            out = eager_attention(q, k, v, hook, self.name, self.scale, self.window)
        elif decode_attention_in_c(q, k, mask):
            n_keys = k.shape[2] if mask is None else cache.n_keys  # a static view masks its unfilled end
            scale = 1 / math.sqrt(self.head_dim) if self.scale is None else self.scale
            out = matvec_kernels.functions().decode_attention(q, k, v, n_keys, scale)
        else:
            out = sdpa_attention(q, k, v, mask, self.scale, self.window)
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
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
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
        K/V there and attends over the whole filled cache (a sliding-window layer: the
        positions its window still sees); ``cache.length`` then grows by T.

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

    def pack_weights(self, long_rows: bool | None = None) -> "Transformer":
        """Lay the weights out for fast decoding; the logits stay the same. Returns the model.

        - Matrices that read the same input are stacked: q|k|v into ``attn.qkv_weight``, and
          gate|up into ``mlp.gate_up_weight``, so a Llama layer runs 4 matmuls instead of 7.
        - ``long_rows`` (default: on CPU, except float16): a decode step multiplies one row
          vector by each matrix, and MKL streams a matrix fastest along long contiguous rows.
          nn.Linear keeps [out, in] rows of length in; a matrix with out >= in (q|k|v, gate|up,
          o, the LM head) is stored transposed instead, strides (1, out). BENCHMARKS.md has the
          numbers. (CPU float16 products with transposed weights fall to a slow kernel when
          there are many rows: 241 vs 14 ms for a 64-row prefill through gate|up, measured.)

        Parameters keep their names, shapes and values: each becomes a view of its packed
        matrix, so memory is not doubled; the other parameters are copied too, so no tensor
        keeps a memory-mapped checkpoint file resident. Call it again after moving the model
        to another device.
        """
        if long_rows is None:
            weight = self.embed.weight
            long_rows = weight.device.type == "cpu" and weight.dtype != torch.float16
        originals = {id(p): p for p in self.parameters()}  # (holding them keeps their ids unique)
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            attn.qkv_weight, attn.qkv_bias = _pack([attn.q_proj, attn.k_proj, attn.v_proj], long_rows)
            _pack([attn.o_proj], long_rows)
            if isinstance(mlp, SwiGLU):
                mlp.gate_up_weight, mlp.gate_up_bias = _pack([mlp.gate_proj, mlp.up_proj], long_rows)
            else:
                _pack([mlp.up_proj], long_rows)
            _pack([mlp.down_proj], long_rows)
        tied = self.lm_head.weight is self.embed.weight
        _pack([self.lm_head], long_rows)  # the LM head is the largest matrix of a small model
        if tied:
            self.embed.weight = self.lm_head.weight  # looking up rows of a column-major table works alike
        for module in self.modules():  # the rest (norms, an untied embedding) gets its own memory too, so
            for name, p in list(module.named_parameters(recurse=False)):  # nothing pins a memory-mapped file
                if id(p) in originals:
                    setattr(module, name, nn.Parameter(p.detach().clone(), requires_grad=False))
        return self

    def num_parameters(self) -> int:
        """Distinct parameters (a tied LM head is counted once). A quantised matrix
        (:mod:`minillm.quantize`) counts the weights its codes stand for, so the count does not
        change with the format; the quantised copy of a tied head is not counted again."""
        from .quantize import QuantizedLinear

        n = sum(p.numel() for p in self.parameters())
        for m in self.modules():
            if isinstance(m, QuantizedLinear):
                n += m.out_features * m.in_features + (0 if m.bias is None else m.bias.numel())
        if self._head_is_quantised_copy():
            n -= self.lm_head.out_features * self.lm_head.in_features
        return n

    def weights_bytes(self) -> int:
        """Bytes of all distinct parameters, i.e. what one decode step must read.

        A quantised model (:mod:`minillm.quantize`) counts its int8/int4 codes, scales and zeros.
        Its tied LM head reads a quantised copy while the lookup reads one row of the float
        embedding: the copy is counted, the float table is not (it is memory, not traffic).
        """
        from .quantize import QuantizedLinear

        params = sum(p.numel() * p.element_size() for p in self.parameters())
        quantized = sum(m.weights_bytes() for m in self.modules() if isinstance(m, QuantizedLinear))
        if self._head_is_quantised_copy():
            params -= self.embed.weight.numel() * self.embed.weight.element_size()
        return params + quantized

    def _head_is_quantised_copy(self) -> bool:
        """A tied LM head that quantize_model replaced by a quantised copy of the float embedding."""
        from .quantize import QuantizedLinear

        return isinstance(self.lm_head, QuantizedLinear) and self.config.tie_word_embeddings
