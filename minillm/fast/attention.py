"""Attention, faster: q|k|v in one product, and decode's and prefill's attention in C.

Decode's attention reads each layer's K and V once for a few FLOPs a byte, and SDPA's CPU kernel
spends its time elsewhere: a compiled SmolLM2-135M float32 step on the developers' 2-core EPYC took
40.0-42.6 ms with the C loop (:func:`minillm.fast.kernels.decode_attention`, flash-decoding's split
of the keys) against 44.3-44.7 ms with SDPA at 128 positions, and 45.8-50.7 against 52.8-59.1 ms at
1,000 (BENCHMARKS-HISTORY.md). In bfloat16 the loop widens each chunk of the cache to float32 as it
reads it, where SDPA's CPU kernel took 7.7x its float32 time on that EPYC (1,024 keys: 555 against 72 us;
BENCHMARKS.md, "The AMD EPYC: decode at each format"). It runs for one float32 or bfloat16 CPU query a
sequence (T = 1) over a cache with contiguous rows, head_dim a multiple of 8, and no mask but a static
buffer's (its unfilled end); everything else is :class:`~minillm.model.Attention`'s own. Same values as
SDPA up to float rounding.

Prefill's causal attention (many queries, the last T of the S positions, no mask) runs
:func:`minillm.fast.kernels.causal_attention`, a flash-attention loop that never computes the masked
half: SDPA's CPU kernel took as long for causal as for full attention. SmolLM2-135M's shapes (9 heads,
3 K/V heads, head_dim 64, 2 threads, Intel Xeon, 2026-12-03): T = S = 480 1.31 against 2.13 ms a
layer, T = 512 onto 488 cached 3.99 against 5.30, T = S = 2048 18.95 against 21.67. Below
PREFILL_MIN_SCORES query-key pairs (T = S = 64: 69 against 54 us) SDPA's lighter set-up wins and runs.
In bfloat16 both products run on pairs of bfloat16s instead (:func:`minillm.fast.kernels.causal_attention_bf16`,
``bf16_prefill``): on the matrix units where the CPU has them (Intel AMX), else by AVX512-BF16's dot products; on
the developers' AMD EPYC (no AMX) T = S = 480 took 1.02 ms a layer against 2.31 for the float32 loop on widened K and
V (which still serves bfloat16 on a CPU without AVX512-BF16) and 3.94 for SDPA (BENCHMARKS.md, "The AMD EPYC, a
third time").
"""

from __future__ import annotations

import math

import torch

from ..model import Attention
from . import kernels
from .packing import Stack

PREFILL_MIN_SCORES = 8192  # T·S; measured: T = S = 96 (9,216) 104 against SDPA's 137 us, T = S = 64 69 against 54
BF16_MIN_SCORES = 4096  # T·S; measured on AMX: T = S = 64 45 against SDPA's 50 us, T = S = 16 32 against 23
BF16_MIN_QUERIES = 16  # one block of queries: the kernel packs all S keys and values a call, for T · heads / Hkv rows


class FastAttention(Attention):
    """:class:`~minillm.model.Attention` with the same parameters, q|k|v stacked (``qkv``) and, with
    ``c_decode`` (set where :func:`c_decode_fits`), decode's attention in C, with ``c_prefill`` (also
    head_dim a multiple of the kernels' panel width) prefill's causal attention in C, and with ``c_rope`` (set
    where :func:`c_kernels_fit`, float32 or bfloat16) RoPE of q and k in one C call, the lesson's values, and with
    ``bf16_prefill`` (set where :func:`bf16_prefill_fits`) prefill's causal attention on pairs of bfloat16s where
    :func:`prefill_in_bf16`."""

    qkv: Stack | None = None
    c_decode: bool = False
    c_prefill: bool = False
    c_rope: bool = False
    bf16_prefill: bool = False

    def _apply(self, fn, recurse=True):
        self.qkv = None  # .to(), .double(), .cuda() make new tensors: the stack would be stale; the members stay
        return super()._apply(fn, recurse)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None or not self.qkv.fresh(self):
            return super().project_qkv(x)
        kv_size = self.n_kv_heads * self.head_dim
        return self.qkv.module(x).split((self.n_heads * self.head_dim, kv_size, kv_size), dim=-1)

    def rotate(self, q, k, rope_cos_sin):
        cos, sin = rope_cos_sin
        if (self.c_rope and kernels.rope_fits(q, k, cos, sin) and not torch.compiler.is_compiling()
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
            return kernels.rope(q, k, cos, sin, check=False)
        return super().rotate(q, k, rope_cos_sin)

    def attend(self, q, k, v, mask, impl, hook):
        if impl == "sdpa" and mask is None and self.window is None and self.bf16_prefill and prefill_in_bf16(q, k, v):
            return kernels.causal_attention_bf16(q, k, v, score_scale(self), check=False)  # (prefill_in_bf16 checked)
        if impl == "sdpa" and self._prefill_in_c(q, k, v, mask):
            return kernels.causal_attention(q, k, v, score_scale(self))
        if not (impl == "sdpa" and self._in_c(q, k, mask)):
            return super().attend(q, k, v, mask, impl, hook)
        if self.window is not None and mask is None:  # as Attention.attend: the keys the window still sees
            k, v = k[:, :, -self.window:], v[:, :, -self.window:]
        n_keys = k.shape[2] if mask is None else mask.sum(-1)  # a static buffer masks its unfilled end
        return kernels.functions().decode_attention(q, k, v, n_keys, score_scale(self))

    def impl_name(self, n_queries: int, impl: str, n_keys: int | None = None) -> str:
        n_keys = n_queries if n_keys is None else n_keys
        if impl == "sdpa" and self.bf16_prefill and self.window is None and _bf16_pays(n_queries, n_keys):
            return "amx" if kernels.bf16_amx_ready() else "c"
        in_c = self.c_decode if n_queries == 1 else self._prefill_fits(n_queries, n_keys)
        return "c" if in_c and impl == "sdpa" else impl

    def _prefill_fits(self, n_queries: int, n_keys: int) -> bool:
        """A causal pass of many queries, enough of them to pay for the C loop (a window: SDPA's)."""
        return self.c_prefill and self.window is None and prefill_pays(n_queries, n_keys)

    def _prefill_in_c(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
        return (mask is None and self._prefill_fits(q.shape[2], k.shape[2])
                and q.dtype in (torch.float32, torch.bfloat16) and q.dtype == k.dtype == v.dtype
                and q.device.type == "cpu" and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
                and not (torch.is_grad_enabled() and q.requires_grad) and not torch.compiler.is_compiling())

    def _in_c(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
        return (self.c_decode and q.shape[2] == 1 and q.device.type == "cpu"
                and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype
                and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]
                and not (torch.is_grad_enabled() and q.requires_grad)
                and (mask.dim() == 2 if mask is not None else not torch.compiler.is_compiling()))


def score_scale(attn: Attention) -> float:
    """The factor an attention's scores q·k are multiplied by: its ``scale`` (``ModelConfig.attn_scale``), or
    1/√head_dim where it is None (SDPA's default)."""
    return 1 / math.sqrt(attn.head_dim) if attn.scale is None else attn.scale


def prefill_in_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a bfloat16 pass of several queries runs :func:`minillm.fast.kernels.causal_attention_bf16`: what the
    kernel takes (bfloat16 on a CPU with AVX512-BF16, head_dim a multiple of 32), enough queries and query-key pairs to
    pay for its set-up (BF16_MIN_QUERIES, BF16_MIN_SCORES: not a decode step), no autograd, not while compiling."""
    return (_bf16_pays(q.shape[2], k.shape[2]) and q.dtype == torch.bfloat16 and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and q.requires_grad) and kernels.causal_attention_bf16_fits(q, k, v))


def prefill_pays(n_queries: int, n_keys: int) -> bool:
    """Whether a causal pass of ``n_queries`` over ``n_keys`` positions is enough work for
    :func:`~minillm.fast.kernels.causal_attention`'s set-up (PREFILL_MIN_SCORES query-key pairs, not a decode)."""
    return n_queries > 1 and n_queries * n_keys >= PREFILL_MIN_SCORES


def _bf16_pays(n_queries: int, n_keys: int) -> bool:
    return n_queries >= BF16_MIN_QUERIES and n_queries * n_keys >= BF16_MIN_SCORES


def bf16_prefill_fits(model) -> bool:
    """Whether prefill's attention can run on pairs of bfloat16s for this model: bfloat16 on a CPU with AVX512-BF16,
    head_dim a multiple of 32 up to 256, the kernels built."""
    weight = model.embed.weight
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and model.config.head_dim % 32 == 0
            and model.config.head_dim <= 256 and kernels.available() and kernels.bf16_dot_instructions())


def c_decode_fits(model) -> bool:
    """Whether decode's attention can run in C for this model: float32 or bfloat16 on a CPU, head_dim a
    multiple of 8, and the kernels built."""
    weight = model.embed.weight
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and model.config.head_dim % 8 == 0 and kernels.available())


def c_kernels_fit(model) -> bool:
    """Whether the kernels that take float32 and bfloat16 alike (the block's RMSNorms, the serving batch's
    paged decode attention) run for this model: float32 or bfloat16 on a CPU, head_dim a multiple of 8, and
    the kernels built."""
    weight = model.embed.weight
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and model.config.head_dim % 8 == 0 and kernels.available())
