"""Deliberately wrong implementations: the classic mistakes, one each, named after the mistake.

``test_mistakes_are_caught.py`` runs every check of an exercise against each of its
mistakes and requires the check the mistake names to fail with a teaching message, and
none to crash: a check that passes a wrong implementation is not honest.

A mistake replaces one name of its exercise (see ``registry.py``): a function, or one
method of a class (``"KVCache.write"``: the wrong ``write`` goes into a subclass of
minillm's KVCache). Each names a check that rejects it (``caught_by``). It is written one of
two ways:

- a function of its own, under ``@mistake(exercise, name it replaces, caught_by)``: its name is
  the mistake's, its docstring says what is wrong, the line that is wrong is marked ``# MISTAKE``;
- a row of a table, where one helper written plainly has knobs and each mistake turns some:
  ``mistakes(exercise, name it replaces, factory, rows)``, a row being (the mistake's name, the
  knobs it turns, caught_by, what is wrong). The factory makes the function, with the replaced
  name's signature (what a check may pass it), that calls the helper with those knobs.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable

import torch

from minillm.block_hash import hash_block
from minillm.costs import (PhaseCost, attention_flops, attention_params, decode_cost, flops_per_token,
                           kv_bytes_per_token, lm_head_params, mlp_params, weights_bytes)
from minillm.generate import GenerationStep
from minillm.hardware import OVERHEAD_FACTOR, Roofline
from minillm.errors import CacheFullError
from minillm.kv_cache import KVCache
from minillm.metrics import RequestMetrics, percentile
from minillm.model import causal_mask
from minillm.phases import decode_step, prefill
from minillm.quantize import QuantizationError, dequantize_int4, pack_int4, quantize_int4
from minillm.rope import RotaryEmbedding, rope_inv_freq
from minillm.sampling import filter_logits, sample
from minillm.serving.request import RUNNING, WAITING
from minillm.serving.scheduler import ScheduledBatch

from exercises.registry import StandIn, stand_in

INF = float("inf")


@dataclass(frozen=True)
class Mistake(StandIn):
    """A wrong ``fn`` standing in for ``replaces`` of ``exercise``; its docstring says what is wrong,
    and ``caught_by`` names a check of the exercise that rejects it."""

    caught_by: str

    @property
    def what(self) -> str:
        """What is wrong: the docstring's first paragraph, on one line."""
        return " ".join(inspect.getdoc(self.fn).split("\n\n")[0].split())


MISTAKES: list[Mistake] = []


def mistake(exercise: str, replaces: str, caught_by: str):
    return stand_in(MISTAKES, Mistake, exercise, replaces, caught_by=caught_by)


def mistakes(exercise: str, replaces: str, factory: Callable[..., Callable], rows: list[tuple[str, dict, str, str]]):
    """One mistake per row (name, knobs, caught_by, what is wrong): ``factory(**knobs)`` under the mistake's
    name, which also names it in this module (a student's file may import it, as test_class_reports' does)."""
    for name, knobs, caught_by, what in rows:
        fn = factory(**knobs)
        fn.__name__, fn.__qualname__, fn.__doc__ = name, name, what
        globals()[name] = fn
        MISTAKES.append(Mistake(exercise, replaces, fn, caught_by))


def swap_in(m: Mistake, impl: SimpleNamespace) -> SimpleNamespace:
    """A copy of ``impl`` with the mistake in place of the name it replaces."""
    ns = SimpleNamespace(**vars(impl))
    if "." not in m.replaces:
        setattr(ns, m.replaces, m.fn)
        return ns
    cls_name, method = m.replaces.split(".")
    base = getattr(impl, cls_name)
    wrong = classmethod(m.fn) if isinstance(inspect.getattr_static(base, method), classmethod) else m.fn
    setattr(ns, cls_name, type(m.name, (base,), {method: wrong}))
    return ns


# -- ex01 causal mask ------------------------------------------------------------------------------


@mistake("ex01", "causal_mask", "test_prompt_mask_is_lower_triangular")
def mask_off_by_one(n_queries, n_keys, device=None):
    """Each token also sees the next one: the diagonal is one too far."""
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    return ones.tril(diagonal=n_keys - n_queries + 1)  # MISTAKE: + 1


@mistake("ex01", "causal_mask", "test_queries_after_a_cache_see_every_cached_key")
def mask_assumes_square(n_queries, n_keys, device=None):
    """Queries after a non-empty cache masked as if square: tril() hides the cached keys."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril()  # MISTAKE: diagonal 0


@mistake("ex01", "causal_mask", "test_prompt_mask_is_lower_triangular")
def mask_inverted(n_queries, n_keys, device=None):
    """True where attention is forbidden (masked_fill's convention) instead of where it is allowed."""
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    return ~ones.tril(diagonal=n_keys - n_queries)  # MISTAKE: ~


# issue 30: mistakes in the window and the edge sizes, written from the stub alone


@mistake("ex01", "causal_mask", "test_agrees_with_the_reference_on_every_size_and_window")
def mask_window_ignored(n_queries, n_keys, device=None, window=None):
    """The window ignored entirely (never cuts the band): a sliding-window model sees every earlier key."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n_queries)  # MISTAKE


@mistake("ex01", "causal_mask", "test_agrees_with_the_reference_on_every_size_and_window")
def mask_window_off_by_one(n_queries, n_keys, device=None, window=None):
    """A window one key too wide: the band keeps window + 1 keys, position - W <= j <= position."""
    mask = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n_queries)
    if window is not None:
        mask = mask.triu(diagonal=n_keys - n_queries - window)  # MISTAKE: - window + 1
    return mask


@mistake("ex01", "causal_mask", "test_agrees_with_the_reference_on_every_size_and_window")
def mask_window_assumes_square(n_queries, n_keys, device=None, window=None):
    """The window's band counted from the query's row, not its position: wrong after a KV cache."""
    mask = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=n_keys - n_queries)
    if window is not None:
        mask = mask.triu(diagonal=1 - window)  # MISTAKE: n_keys - n_queries - window + 1
    return mask


@mistake("ex01", "causal_mask", "test_agrees_with_the_reference_on_every_size_and_window")
def mask_rows_stacked(n_queries, n_keys, device=None, window=None):
    """Builds the mask row by row and stacks the rows: torch.stack([]) fails for 0 queries."""
    rows = []
    for i in range(n_queries):
        position = n_keys - n_queries + i
        low = 0 if window is None else max(0, position - window + 1)
        rows.append(torch.tensor([low <= j <= position for j in range(n_keys)], dtype=torch.bool, device=device))
    return torch.stack(rows)  # MISTAKE: no rows when n_queries == 0


# -- ex02 attention, ex04 grouped-query attention -----------------------------------------------------


def _attention(q, k, v, scale=None, mask=causal_mask, softmax_dim=-1, root=True):
    """minillm's eager attention with its parts exchangeable (the mistakes below pass wrong ones)."""
    B, n_heads, T, head_dim = q.shape
    n_kv_heads, S = k.shape[1], k.shape[2]
    q = q.reshape(B, n_kv_heads, n_heads // n_kv_heads, T, head_dim)
    scale = 1 / (math.sqrt(head_dim) if root else head_dim) if scale is None else scale
    scores = q @ k.unsqueeze(2).transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask(T, S, q.device), -INF)
    pattern = torch.softmax(scores, dim=softmax_dim)
    return (pattern @ v.unsqueeze(2)).reshape(B, n_heads, T, head_dim)


def _attention_as(**knobs):
    def eager_attention(q, k, v, hook=None, name=""):
        return _attention(q, k, v, **knobs)

    return eager_attention


mistakes("ex02", "eager_attention", _attention_as, [
    ("attention_without_scale", dict(scale=1.0), "test_scores_are_scaled_by_sqrt_head_dim",
     "No 1/√head_dim: the scores grow with head_dim and the softmax saturates."),
    ("attention_scaled_by_head_dim", dict(root=False), "test_scores_are_scaled_by_sqrt_head_dim",
     "Divides by head_dim instead of √head_dim."),
    ("attention_softmax_over_queries", dict(softmax_dim=-2), "test_scores_are_scaled_by_sqrt_head_dim",
     "Softmax over the queries (dim -2) instead of the keys."),
    ("attention_without_mask", dict(mask=None), "test_no_query_sees_a_later_token",
     "No causal mask: every token sees the future."),
    ("attention_mask_off_by_one", dict(mask=mask_off_by_one), "test_no_query_sees_a_later_token",
     "The mask lets each token see the next one."),
    ("attention_mask_assumes_square", dict(mask=mask_assumes_square), "test_queries_after_a_cache_see_the_cached_keys",
     "A multi-token query against a non-empty cache masked as if square (T×T tril on T×S scores)."),
])


@mistake("ex02", "eager_attention", "test_an_explicit_scale_replaces_one_over_sqrt_head_dim")
def attention_ignores_the_scale_argument(q, k, v, hook=None, name="", scale=None):
    """Always divides by √head_dim, also when the model gives its own scale."""
    return _attention(q, k, v)  # MISTAKE: _attention(q, k, v, scale=scale)


# issue 30: mistakes in dtypes, windows and inputs, written from the stub and lesson alone


def _scores(q, k, scale, window):
    """Masked scores [B, n_heads, T, S] of a plain multi-head attention (the mistakes below differ after)."""
    T, S = q.shape[2], k.shape[2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    return scores.masked_fill(~causal_mask(T, S, q.device, window), -INF)


@mistake("ex02", "eager_attention", "test_agrees_with_the_reference_in_every_dtype_size_scale_and_window")
def attention_softmax_without_the_max(q, k, v, hook=None, name="", scale=None, window=None):
    """Softmax written as exp(s) / sum exp(s) without subtracting the max: inf / inf = NaN for large scores."""
    e = _scores(q, k, scale, window).exp()  # MISTAKE: (scores - scores.amax(-1, keepdim=True)).exp()
    return (e / e.sum(dim=-1, keepdim=True)) @ v


@mistake("ex02", "eager_attention", "test_agrees_with_the_reference_in_every_dtype_size_scale_and_window")
def attention_ignores_window(q, k, v, hook=None, name="", scale=None, window=None):
    """Takes window= but builds the plain causal mask: a sliding-window layer sees every earlier key."""
    return torch.softmax(_scores(q, k, scale, None).float(), dim=-1).to(q.dtype) @ v  # MISTAKE: window


@mistake("ex02", "eager_attention", "test_agrees_with_the_reference_in_every_dtype_size_scale_and_window")
def attention_window_ignores_the_cache(q, k, v, hook=None, name="", scale=None, window=None):
    """The window's band cut by hand from the query's row (as if T == S), not from its position S - T + i."""
    T, S = q.shape[2], k.shape[2]
    scores = _scores(q, k, scale, None)
    if window is not None:
        too_old = ~torch.ones(T, S, dtype=torch.bool).triu(diagonal=1 - window)  # MISTAKE: S - T - window + 1
        scores = scores.masked_fill(too_old, -INF)
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


@mistake("ex02", "eager_attention", "test_agrees_with_the_reference_in_every_dtype_size_scale_and_window")
def attention_returns_float32(q, k, v, hook=None, name="", scale=None, window=None):
    """The softmax upcast to float32 for accuracy and never cast back: a bfloat16 model gets float32 out."""
    pattern = torch.softmax(_scores(q, k, scale, window).float(), dim=-1)
    return pattern @ v.float()  # MISTAKE: pattern.to(q.dtype) @ v


@mistake("ex02", "eager_attention", "test_scores_are_scaled_by_sqrt_head_dim")
def attention_scales_q_in_place(q, k, v, hook=None, name="", scale=None, window=None):
    """Scales q in place (q.mul_) to save a tensor: the caller's q is changed."""
    q = q.mul_(1 / math.sqrt(q.shape[-1]) if scale is None else scale)  # MISTAKE: q * scale
    return torch.softmax(_scores(q, k, 1.0, window).float(), dim=-1).to(q.dtype) @ v


@mistake("ex04", "eager_attention", "test_consecutive_query_heads_share_a_kv_head")
def gqa_heads_tiled_not_grouped(q, k, v, hook=None, name=""):
    """K/V heads repeated as a tile (query head h reads K/V head h % n_kv_heads), not in groups."""
    n_rep = q.shape[1] // k.shape[1]
    return _attention(q, k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1))  # MISTAKE: repeat, not repeat_interleave


@mistake("ex04", "eager_attention", "test_consecutive_query_heads_share_a_kv_head")
def gqa_every_query_head_reads_kv_head_0(q, k, v, hook=None, name=""):
    """Only the first K/V head is used, broadcast to every query head."""
    n_heads = q.shape[1]
    return _attention(q, k[:, :1].expand(-1, n_heads, -1, -1), v[:, :1].expand(-1, n_heads, -1, -1))  # MISTAKE


# issue 30: grouped-query attention beyond the scripted 4/2, 4/1, 4/4 heads, written from the stub alone


def _gqa_pattern(q, k, scale, window):
    """Grouped scores [B, n_kv_heads, n_rep, T, S] after the mask (the mistakes below differ after)."""
    B, n_heads, T, D = q.shape
    n_kv_heads, S = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    scores = q.reshape(B, n_kv_heads, n_heads // n_kv_heads, T, D) @ k.unsqueeze(2).transpose(-1, -2) * scale
    return scores.masked_fill(~causal_mask(T, S, q.device, window), -INF)


@mistake("ex04", "eager_attention", "test_consecutive_query_heads_share_a_kv_head")
def gqa_output_heads_interleaved(q, k, v, hook=None, name="", scale=None, window=None):
    """Output [B, n_kv_heads, n_rep, T, D] transposed before the reshape: head g·n_rep + r comes out as r·n_kv + g."""
    B, n_heads, T, D = q.shape
    pattern = torch.softmax(_gqa_pattern(q, k, scale, window).float(), dim=-1).to(q.dtype)
    out = pattern @ v.unsqueeze(2)
    return out.transpose(1, 2).reshape(B, n_heads, T, D)  # MISTAKE: out.reshape(B, n_heads, T, D)


@mistake("ex04", "eager_attention", "test_agrees_with_the_reference_for_every_group_size_dtype_and_cache")
def gqa_ignores_the_scale_argument(q, k, v, hook=None, name="", scale=None, window=None):
    """GQA added to a solution that always divides by √head_dim: a model's own scale is lost."""
    B, n_heads, T, D = q.shape
    pattern = torch.softmax(_gqa_pattern(q, k, None, window).float(), dim=-1).to(q.dtype)  # MISTAKE: scale
    return (pattern @ v.unsqueeze(2)).reshape(B, n_heads, T, D)


@mistake("ex04", "eager_attention", "test_agrees_with_the_reference_for_every_group_size_dtype_and_cache")
def gqa_ignores_window(q, k, v, hook=None, name="", scale=None, window=None):
    """GQA with the plain causal mask: Mistral's sliding window (GQA 32/8) is not applied."""
    B, n_heads, T, D = q.shape
    pattern = torch.softmax(_gqa_pattern(q, k, scale, None).float(), dim=-1).to(q.dtype)  # MISTAKE: window
    return (pattern @ v.unsqueeze(2)).reshape(B, n_heads, T, D)


@mistake("ex04", "eager_attention", "test_agrees_with_the_reference_for_every_group_size_dtype_and_cache")
def gqa_returns_float32(q, k, v, hook=None, name="", scale=None, window=None):
    """The softmax in float32 and the values upcast to match: a bfloat16 model gets float32 out."""
    B, n_heads, T, D = q.shape
    pattern = torch.softmax(_gqa_pattern(q, k, scale, window).float(), dim=-1)
    return (pattern @ v.unsqueeze(2).float()).reshape(B, n_heads, T, D)  # MISTAKE: .to(q.dtype)


@mistake("ex04", "eager_attention", "test_agrees_with_the_reference_for_every_group_size_dtype_and_cache")
def gqa_softmax_without_the_max(q, k, v, hook=None, name="", scale=None, window=None):
    """exp(s) / sum exp(s) without the max subtracted: NaN in float16 (and float32) once scores are large."""
    B, n_heads, T, D = q.shape
    e = _gqa_pattern(q, k, scale, window).exp()  # MISTAKE: subtract the row's max first
    return (e / e.sum(-1, keepdim=True) @ v.unsqueeze(2)).reshape(B, n_heads, T, D)


# -- ex03 RoPE -----------------------------------------------------------------------------------------


@mistake("ex03", "RotaryEmbedding.forward", "test_tables_at_a_decode_position")
def rope_positions_restart_at_zero(self, positions, dtype):
    """Ignores the given positions and counts from 0: every decode token rotated as position 0."""
    positions = torch.arange(len(positions))  # MISTAKE
    return RotaryEmbedding.forward(self, positions, dtype)


@mistake("ex03", "RotaryEmbedding.forward", "test_tables_for_a_prompt")
def rope_tables_repeat_interleaved(self, positions, dtype):
    """cos/sin laid out (θ0, θ0, θ1, θ1, ...) for adjacent pairs, while apply_rope pairs the halves."""
    angles = positions.float()[:, None] * self.inv_freq[None, :]
    angles = angles.repeat_interleave(2, dim=-1)  # MISTAKE: torch.cat((angles, angles), -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@mistake("ex03", "RotaryEmbedding.forward", "test_tables_far_from_position_0_in_bfloat16")
def rope_angles_in_low_precision(self, positions, dtype):
    """Computes positions · inv_freq in the model's dtype: in bfloat16 the angles past ~100 are rounded."""
    angles = positions.to(dtype)[:, None] * self.inv_freq.to(dtype)[None, :]  # MISTAKE: in float32, then cast
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@mistake("ex03", "apply_rope", "test_rotation_of_a_batch_in_bfloat16")
def rope_upcasts_to_float32(x, cos, sin):
    """Returns float32 for a bfloat16 x (mixes x with float32 tables): the model's next matmul gets the wrong dtype."""
    x = x.float()  # MISTAKE: stay in x's dtype
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.float() + torch.cat((-x2, x1), dim=-1) * sin.float()


@mistake("ex03", "apply_rope", "test_rotation_by_hand")
def rope_rotates_the_wrong_way(x, cos, sin):
    """Rotates by -angle: (x1·cos + x2·sin, x2·cos - x1·sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos - torch.cat((-x2, x1), dim=-1) * sin  # MISTAKE: - instead of +


@mistake("ex03", "apply_rope", "test_rotation_pairs_the_two_halves")
def rope_pairs_adjacent_channels(x, cos, sin):
    """Rotates the pairs (2i, 2i+1) (GPT-J layout) instead of (i, i + head_dim/2) (HF Llama's)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., 0::2], x[..., 1::2]  # MISTAKE
    c, s = cos[..., :half], sin[..., :half]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


# issue 30: RoPE with the config's scaling, any positions, in place; written from the stub alone


def _tables(angles, factor, dtype):
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


@mistake("ex03", "RotaryEmbedding.forward", "test_tables_agree_with_the_reference_for_every_position_dtype_and_scaling")
def rope_attention_factor_ignored(self, positions, dtype):
    """cos and sin not multiplied by YaRN's attention factor: a YaRN model's attention is too flat."""
    inv_freq = self.inv_freq
    if self.dynamic:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, int(positions.max()) + 1)
    return _tables(positions.float()[:, None] * inv_freq[None, :], 1.0, dtype)  # MISTAKE: self.attention_factor


@mistake("ex03", "RotaryEmbedding.forward", "test_tables_agree_with_the_reference_for_every_position_dtype_and_scaling")
def rope_dynamic_scaling_ignored(self, positions, dtype):
    """Always self.inv_freq: dynamic NTK's base never grows past the original context."""
    angles = positions.float()[:, None] * self.inv_freq[None, :]  # MISTAKE: recompute for dynamic
    return _tables(angles, self.attention_factor, dtype)


@mistake("ex03", "RotaryEmbedding.forward", "test_tables_agree_with_the_reference_for_every_position_dtype_and_scaling")
def rope_frequencies_recomputed_without_scaling(self, positions, dtype):
    """Recomputes 1 / theta^(2i/d) instead of using self.inv_freq: the config's rope_scaling is lost."""
    inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)  # MISTAKE
    return _tables(positions.float()[:, None] * inv_freq[None, :], self.attention_factor, dtype)


@mistake("ex03", "RotaryEmbedding.forward", "test_tables_far_from_position_0_in_bfloat16")
def rope_positions_assumed_contiguous(self, positions, dtype):
    """Counts up from the first position (arange(p0, p0 + T)): wrong for gaps, reordered or batched positions."""
    start = int(positions[0])
    positions = torch.arange(start, start + len(positions))  # MISTAKE: use the positions given
    inv_freq = self.inv_freq
    if self.dynamic:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, int(positions.max()) + 1)
    return _tables(positions.float()[:, None] * inv_freq[None, :], self.attention_factor, dtype)


@mistake("ex03", "apply_rope", "test_rotation_pairs_the_two_halves")
def rope_rotates_x_in_place(x, cos, sin):
    """Rotates x in place to save memory (x.mul_(cos).add_(...)): the caller's q and k are changed."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-x2, x1), dim=-1)
    return x.mul_(cos).add_(rotated_half * sin)  # MISTAKE: x * cos + rotated_half * sin


# -- ex05 KV cache -------------------------------------------------------------------------------------


@mistake("ex05", "KVCache.write", "test_a_decode_write_is_appended_after_the_prompt")
def cache_not_appended(self, layer, k, v):
    """Writes the new K/V at position 0 every time, overwriting the cache instead of appending."""
    T = k.shape[2]
    self.k[layer, :, :, :T] = k  # MISTAKE: at 0, not at self.length
    self.v[layer, :, :, :T] = v
    return self.k[layer, :, :, :T], self.v[layer, :, :, :T]


@mistake("ex05", "KVCache.write", "test_first_write_returns_the_new_entries")
def cache_appended_twice(self, layer, k, v):
    """Writes the new K/V, then appends them again to the returned view."""
    k_all, v_all = KVCache.write(self, layer, k, v)
    return torch.cat([k_all, k], dim=2), torch.cat([v_all, v], dim=2)  # MISTAKE


@mistake("ex05", "KVCache.write", "test_first_write_returns_the_new_entries")
def cache_view_misses_new_tokens(self, layer, k, v):
    """Returns the positions filled before this write, without the new ones."""
    KVCache.write(self, layer, k, v)
    return self.k[layer, :, :, : self.length], self.v[layer, :, :, : self.length]  # MISTAKE: not length + T


@mistake("ex05", "KVCache.write", "test_a_decode_write_is_appended_after_the_prompt")
def cache_length_advanced_in_write(self, layer, k, v):
    """Moves length in write(): with several layers the length is counted once per layer."""
    out = KVCache.write(self, layer, k, v)
    self.length += k.shape[2]  # MISTAKE: advance() does this once, after every layer
    return out


@mistake("ex05", "KVCache.write", "test_a_batch_of_three_sequences")
def cache_writes_only_sequence_0(self, layer, k, v):
    """Stores only the first sequence of the batch (written with batch 1 in mind)."""
    end = self.length + k.shape[2]
    self.k[layer, 0, :, self.length : end] = k[0]  # MISTAKE: [layer, :, ...] = k
    self.v[layer, 0, :, self.length : end] = v[0]
    return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


@mistake("ex05", "KVCache.write", "test_a_decode_write_is_appended_after_the_prompt")
def cache_write_returns_only_the_new_entries(self, layer, k, v):
    """Stores the new K/V but returns only them: attention would never see the cached positions."""
    KVCache.write(self, layer, k, v)
    return k, v  # MISTAKE: the filled views 0 .. length+T-1


@mistake("ex05", "KVCache.write", "test_a_decode_write_is_appended_after_the_prompt")
def cache_write_forgets_the_layer(self, layer, k, v):
    """Indexes without the layer: the new K/V are broadcast into every layer, the last writer wins."""
    end = self.length + k.shape[2]
    self.k[:, :, :, self.length : end] = k  # MISTAKE: self.k[layer, :, :, ...]
    self.v[:, :, :, self.length : end] = v
    return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


@mistake("ex05", "KVCache.write", "test_far_from_position_0_in_each_dtype")
def cache_write_returns_float32(self, layer, k, v):
    """Builds the returned view with torch.cat on float32 copies: a bfloat16 cache comes back as float32."""
    KVCache.write(self, layer, k, v)
    old_k, old_v = self.k[layer, :, :, : self.length].float(), self.v[layer, :, :, : self.length].float()
    return torch.cat([old_k, k.float()], dim=2), torch.cat([old_v, v.float()], dim=2)  # MISTAKE: .float()


@mistake("ex05", "KVCache.keys", "test_keys_and_values_are_the_filled_part")
def cache_keys_ignore_length(self, layer):
    """Returns the whole preallocated buffer, zeros after length included."""
    return self.k[layer]  # MISTAKE: [:, :, :self.length]


# issue 30: the promised error, the promised views, copy-paste; written from the stub alone


@mistake("ex05", "KVCache.write", "test_random_sequences_of_writes_and_reads_agree_with_the_reference")
def cache_write_past_capacity_unchecked(self, layer, k, v):
    """No check of max_seq_len: a write past it fails deep in torch, or (T = 1 at a full cache) writes nothing."""
    end = self.length + k.shape[2]  # MISTAKE: no self.check_room(k.shape[2]) (CacheFullError)
    self.k[layer, :, :, self.length : end] = k
    self.v[layer, :, :, self.length : end] = v
    return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


@mistake("ex05", "KVCache.write", "test_random_sequences_of_writes_and_reads_agree_with_the_reference")
def cache_full_one_position_early(self, layer, k, v):
    """Raises CacheFullError when the write would exactly fill the cache: the last position is never used."""
    end = self.length + k.shape[2]
    if end >= self.max_seq_len:  # MISTAKE: > (a write up to max_seq_len fits)
        raise CacheFullError(f"KV cache full: {end} >= {self.max_seq_len}")
    self.k[layer, :, :, self.length : end] = k
    self.v[layer, :, :, self.length : end] = v
    return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


@mistake("ex05", "KVCache.write", "test_random_sequences_of_writes_and_reads_agree_with_the_reference")
def cache_write_returns_concatenated_copies(self, layer, k, v):
    """Stores k, v, but returns torch.cat(cached, new): right values, but a copy of the whole layer every step."""
    KVCache.write(self, layer, k, v)
    old_k, old_v = self.k[layer, :, :, : self.length], self.v[layer, :, :, : self.length]
    return torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)  # MISTAKE: the views self.k[layer, ..., :end]


@mistake("ex05", "KVCache.keys", "test_random_sequences_of_writes_and_reads_agree_with_the_reference")
def cache_keys_return_a_copy(self, layer):
    """keys() clones the filled part (to be safe): the docstring promises a view, no copy."""
    return self.k[layer, :, :, : self.length].clone()  # MISTAKE: no .clone()


@mistake("ex05", "KVCache.values", "test_keys_and_values_are_the_filled_part")
def cache_values_return_the_keys(self, layer):
    """values() copied from keys() and left reading self.k."""
    return self.k[layer, :, :, : self.length]  # MISTAKE: self.v


# -- ex06 prefill, ex07 decode_step ----------------------------------------------------------------


def _forward(model, ids, cache, checks=True, lower_bound=True, rows=None, room=lambda cache, n: cache.check_room(n),
             from_zero=False, shift=0, advance=True, last=-1, to_float=True):
    """A forward pass with its own input checks and positions, each knob one of the mistakes below."""
    if checks:
        vocab = model.config.vocab_size
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        seen = ids if rows is None else ids[:rows]
        if seen.max() >= vocab or (lower_bound and seen.min() < 0):
            raise ValueError(f"token ids must be in [0, {vocab})")
        if ids.shape[0] != cache.batch_size:
            raise ValueError("batch")
        room(cache, ids.shape[1])
    start = (0 if from_zero else cache.length) + shift
    logits = model(ids, cache=cache, positions=torch.arange(start, start + ids.shape[1]), logits_rows=[last])[:, 0]
    if advance:  # (given the positions, the model leaves the cache's length to its caller)
        cache.advance(ids.shape[1])
    return logits.float() if to_float else logits


def _refuse_when_full(cache, n):
    if cache.length + n >= cache.max_seq_len:  # MISTAKE: > (a prompt may fill the cache exactly)
        raise CacheFullError("full")


def _prefill_as(**knobs):
    def prefill(model, token_ids, cache, hook=None, trace=None):
        return _forward(model, token_ids, cache, **knobs)

    return prefill


def _decode_step_as(**knobs):
    def decode_step(model, token_id, cache, hook=None, trace=None):
        return _forward(model, token_id.reshape(-1, 1), cache, **knobs)

    return decode_step


mistakes("ex06", "prefill", _prefill_as, [
    ("prefill_positions_start_at_zero", dict(checks=False, from_zero=True), "test_prefill_onto_a_filled_cache",
     "Positions from 0 even when the cache already holds a prefix."),
    ("prefill_forgets_to_advance_cache", dict(checks=False, advance=False), "test_the_cache_holds_the_prompt",
     "Writes K/V but leaves cache.length at its old value."),
    ("prefill_returns_first_position_logits", dict(checks=False, last=0), "test_logits_of_the_last_prompt_token",
     "Returns the logits of the first prompt token instead of the last one."),
    ("prefill_trusts_its_input", dict(checks=False), "test_bad_input_is_refused",
     "Right on good input, but an empty prompt, an id outside the vocabulary or a prompt longer than the cache fails "
     "deep inside torch (IndexError, RuntimeError) instead of the promised ValueError/CacheFullError."),
    # issue 30: written from the stub alone (documented inputs never tried, promised errors)
    ("prefill_negative_id_not_checked", dict(lower_bound=False), "test_bad_input_is_refused",
     "Checks ids >= vocab but not ids < 0: a negative id fails inside torch's embedding (IndexError), not the "
     "promised ValueError."),
    ("prefill_logits_in_the_model_dtype", dict(to_float=False),
     "test_agrees_with_the_reference_on_every_kind_of_case_and_dtype",
     "Returns the lm_head's output as it comes: bfloat16 logits from a bfloat16 model, not the promised float32."),
    ("prefill_refuses_a_prompt_that_fills_the_cache", dict(room=_refuse_when_full),
     "test_agrees_with_the_reference_on_every_kind_of_case_and_dtype",
     "CacheFullError when cache.length + T == max_seq_len: the last free positions are never used."),
    ("prefill_checks_the_ids_of_the_first_sequence_only", dict(rows=1),
     "test_agrees_with_the_reference_on_every_kind_of_case_and_dtype",
     "Validates token_ids[0] (the only row of a batch-1 test): a bad id in another row reaches torch."),
])


mistakes("ex07", "decode_step", _decode_step_as, [
    ("decode_position_off_by_one", dict(checks=False, shift=1), "test_one_step_after_the_prompt",
     "The new token is placed at cache.length + 1 instead of cache.length."),
    ("decode_rope_positions_restart_at_zero", dict(checks=False, from_zero=True), "test_one_step_after_the_prompt",
     "Every decode token gets position 0, as if it started a new prompt."),
    ("decode_forgets_to_advance_cache", dict(checks=False, advance=False), "test_one_step_after_the_prompt",
     "cache.length stays put: the next step overwrites this token's K/V."),
    ("decode_trusts_its_input", dict(checks=False), "test_bad_input_is_refused",
     "Right on good input, but a bad id or a full cache fails inside torch instead of the promised errors."),
    # issue 30: written from the stub alone (documented inputs never tried, promised errors)
    ("decode_negative_id_not_checked", dict(lower_bound=False), "test_bad_input_is_refused",
     "Checks id >= vocab but not id < 0: a negative id fails inside torch (IndexError), not ValueError."),
    ("decode_logits_in_the_model_dtype", dict(to_float=False),
     "test_agrees_with_the_reference_on_every_kind_of_case_and_dtype",
     "Returns bfloat16 logits from a bfloat16 model, not the promised float32."),
    ("decode_refuses_the_last_free_position", dict(room=_refuse_when_full),
     "test_agrees_with_the_reference_on_every_kind_of_case_and_dtype",
     "CacheFullError when one position is still free (cache.length + 1 >= max_seq_len)."),
])


@mistake("ex07", "decode_step", "test_agrees_with_the_reference_on_every_kind_of_case_and_dtype")
def decode_tokens_as_one_sequence(model, token_id, cache, hook=None, trace=None):
    """token_id.reshape(1, -1): two tokens given for a batch-1 cache run as a 2-token prefill instead of the
    promised ValueError (several tokens for one sequence); a batch of B becomes B tokens of one sequence."""
    ids = token_id.reshape(1, -1)  # MISTAKE: reshape(-1, 1), one token per sequence
    if ids.shape[1] > 1 and cache.batch_size == ids.shape[1]:
        ids = ids.reshape(-1, 1)  # (it patches the batch case it was shown, not the wrong length)
    return _forward(model, ids, cache)


@mistake("ex07", "decode_step", "test_bad_input_is_refused")
def decode_clamps_bad_ids(model, token_id, cache, hook=None, trace=None):
    """Clamps an id outside the vocabulary into [0, vocab) and decodes it: a silent wrong answer, not ValueError."""
    ids = token_id.clamp(0, model.config.vocab_size - 1).reshape(-1, 1)  # MISTAKE: refuse it
    return _forward(model, ids, cache)


# -- ex08 sampling ---------------------------------------------------------------------------------


def _mass_before(sorted_logits):
    """The probability of the tokens before each one, in sorted order (top-p keeps a token while it is < p)."""
    probs = torch.softmax(sorted_logits, dim=-1)
    return probs.cumsum(dim=-1) - probs


def _filter(logits, params, temperature=lambda x, t: x / t, temperature_last=False,
            top_k=lambda x, k: x < torch.topk(x, min(k, x.shape[-1]), dim=-1).values[:, -1:],
            top_p=lambda sorted_x, p: _mass_before(sorted_x) >= p, unsort=True):
    """filter_logits written plainly: the temperature, then top-k's and top-p's tokens to drop, each knob one of
    the mistakes below."""
    x = logits if temperature_last else temperature(logits, params.temperature)
    if params.top_k:
        x = x.masked_fill(top_k(x, params.top_k), -INF)
    if params.top_p < 1:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        drop = top_p(sorted_x, params.top_p)
        x = x.masked_fill(drop.scatter(-1, order, drop) if unsort else drop, -INF)
    return x / params.temperature if temperature_last else x


def _all_but_topks_indices(x, k):
    """The tokens to drop when exactly k are kept (topk's indices): a logit tied with the k-th is dropped too."""
    keep = torch.topk(x, min(k, x.shape[-1]), dim=-1).indices
    return torch.ones_like(x, dtype=torch.bool).scatter(-1, keep, False)


def _filter_logits_as(**knobs):
    def filter_logits(logits, params):
        return _filter(logits, params, **knobs)

    return filter_logits


mistakes("ex08", "filter_logits", _filter_logits_as, [
    ("temperature_multiplies_logits", dict(temperature=lambda x, t: x * t), "test_temperature_divides_the_logits",
     "Multiplies by the temperature instead of dividing."),
    ("top_p_on_logits", dict(top_p=lambda s, p: s.cumsum(dim=-1) - s >= p), "test_top_p_keeps_the_token_that_crosses_p",
     "Accumulates raw logits instead of probabilities against top_p."),
    ("top_p_drops_crossing_token",
     dict(top_p=lambda s, p: (torch.softmax(s, dim=-1).cumsum(dim=-1) > p).index_fill(-1, torch.tensor([0]), False)),
     "test_top_p_keeps_the_token_that_crosses_p",
     "Keeps only tokens whose cumulative probability is <= top_p: the token that crosses it is dropped."),
    ("top_p_masks_everything_when_top_prob_exceeds_p",
     dict(top_p=lambda s, p: torch.softmax(s, dim=-1).cumsum(dim=-1) > p),
     "test_top_p_keeps_the_token_that_crosses_p",
     "cumsum > top_p without keeping the top token: if it alone exceeds top_p, every logit is -inf."),
    ("top_p_mask_left_in_sorted_order", dict(unsort=False), "test_top_p_keeps_the_token_that_crosses_p",
     "Computes the top-p mask on sorted tokens and applies it to the unsorted logits."),
    ("temperature_after_top_p", dict(temperature_last=True), "test_temperature_comes_before_top_p",
     "Filters with top-k/top-p on the raw logits and divides by the temperature last."),
    ("top_k_threshold_across_the_batch", dict(top_k=lambda x, k: x < torch.topk(x.flatten(), k).values[-1]),
     "test_temperature_top_k_top_p_together_on_a_batch",
     "Takes the k-th largest logit of the whole batch, not of each row."),
    # issue 30: written from the stub alone (ties, sizes)
    ("top_k_drops_tied_logits", dict(top_k=_all_but_topks_indices), "test_filter_logits_agrees_with_the_reference",
     "Keeps exactly k tokens (topk's indices): logits tied with the k-th are dropped, though the docstring keeps them "
     "all."),
    ("top_k_larger_than_the_vocabulary_crashes", dict(top_k=lambda x, k: x < torch.topk(x, k, dim=-1).values[:, -1:]),
     "test_filter_logits_agrees_with_the_reference",
     "torch.topk(logits, params.top_k) without min(top_k, vocab): top_k above the vocabulary size raises."),
])


@mistake("ex08", "filter_logits", "test_temperature_comes_before_top_p")
def filter_logits_in_place(logits, params):
    """Divides the caller's logits in place (logits /= temperature, masked_fill_): right values, changed input."""
    logits.div_(params.temperature)  # MISTAKE: a new tensor
    logits.copy_(_filter(logits, params, temperature=lambda x, t: x))
    return logits


@mistake("ex08", "sample", "test_logprob_ignores_the_temperature")
def logprob_under_the_tempered_distribution(logits, params, generator=None):
    """Reports log_softmax(logits / temperature) instead of the model's own log-probability."""
    token_ids, _ = sample(logits, params, generator)
    tempered = logits if params.greedy else logits / params.temperature  # MISTAKE: the raw logits
    return token_ids, torch.log_softmax(tempered, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)


@mistake("ex08", "sample", "test_same_seed_same_tokens")
def sample_ignores_the_generator(logits, params, generator=None):
    """Draws with torch.multinomial(probs, 1) from the global RNG: the seed does not repeat a run."""
    if params.greedy:
        return sample(logits, params)
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    token_ids = torch.multinomial(probs, num_samples=1).squeeze(-1)  # MISTAKE: generator=generator
    return token_ids, torch.log_softmax(logits, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)


@mistake("ex08", "sample", "test_greedy_takes_the_argmax")
def temperature_zero_divides_by_zero(logits, params, generator=None):
    """Temperature 0 goes through logits / 0 (inf, nan) instead of taking the argmax."""
    probs = torch.softmax(filter_logits(logits, params), dim=-1)  # MISTAKE: no greedy branch
    token_ids = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return token_ids, torch.log_softmax(logits, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)


@mistake("ex08", "sample", "test_logprob_is_the_models_not_the_filtered_one")
def logprob_after_filtering(logits, params, generator=None):
    """Reports the logprob under the filtered distribution instead of the model's own."""
    filtered = logits if params.greedy else filter_logits(logits, params)
    if params.greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        token_ids = torch.multinomial(torch.softmax(filtered, -1), num_samples=1, generator=generator).squeeze(-1)
    return token_ids, torch.log_softmax(filtered, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)  # MISTAKE


# issue 30: ex08 mistakes written from the stub alone (promised errors, dtypes, the seed)


def _sample(logits, params, generator, check=True, upcast=True, shift=True, own_generator=False):
    """sample written plainly, each knob one of the mistakes below."""
    if own_generator:
        generator = torch.Generator().manual_seed(params.seed or 0)
    x = logits.float() if upcast else logits
    if check and not torch.isfinite(x.float().amax(dim=-1)).all():
        raise ValueError("logits must be finite or -inf, with a finite value in every row")
    if params.greedy:
        token_ids = x.argmax(dim=-1)
    else:
        shifted = x - x.amax(dim=-1, keepdim=True) if shift else x
        probs = torch.softmax(filter_logits(shifted, params), dim=-1)
        token_ids = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return token_ids, torch.log_softmax(x, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)


def _sample_as(**knobs):
    def sample(logits, params, generator=None):
        return _sample(logits, params, generator, **knobs)

    return sample


mistakes("ex08", "sample", _sample_as, [
    ("sample_accepts_nan_logits", dict(check=False), "test_sample_agrees_with_the_reference",
     "Never checks the logits: a NaN row is sampled (greedy's argmax picks the NaN) instead of the promised "
     "ValueError."),
    ("sample_in_the_logits_dtype", dict(upcast=False), "test_sample_agrees_with_the_reference",
     "Computes in the logits' own dtype: bfloat16 logprobs (and rounding) where float32 is promised."),
    ("sample_without_the_shift", dict(shift=False), "test_a_small_temperature_on_large_logits",
     "Filters the raw logits without moving the max to 0: huge logits over a small temperature overflow to inf."),
    ("sample_makes_its_own_generator", dict(own_generator=True), "test_same_seed_same_tokens",
     "Seeds a fresh torch.Generator from params.seed on every call instead of drawing from the one given: every call "
     "draws the same token, and the caller's seed means nothing."),
])


@mistake("ex08", "sample", "test_greedy_takes_the_argmax")
def sample_greedy_logprob_of_the_filtered_logits(logits, params, generator=None):
    """Greedy's logprob taken after top-k/top-p (0.0 under top_k=1), not under the model's own raw logits."""
    token_ids, logprobs = _sample(logits, params, generator)
    if params.greedy and (params.top_k or params.top_p < 1):
        kept = filter_logits(logits.float(), replace(params, temperature=1.0))  # MISTAKE: the raw logits
        logprobs = torch.log_softmax(kept, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)
    return token_ids, logprobs


# -- ex09 metrics ----------------------------------------------------------------------------------


@mistake("ex09", "RequestMetrics.from_timestamps", "test_latencies_by_hand")
def tpot_includes_first_token(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                              peak_bandwidth=None):
    """TPOT = e2e / n: the first token, which waited for the prefill, is averaged in."""
    m = RequestMetrics.from_timestamps(start_s, token_times_s, n_prompt_tokens)
    return replace(m, tpot_ms=m.e2e_ms / m.n_output_tokens)  # MISTAKE: (e2e - ttft) / (n - 1)


@mistake("ex09", "RequestMetrics.from_timestamps", "test_latencies_by_hand")
def latency_in_seconds_not_ms(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                              peak_bandwidth=None):
    """Latencies left in seconds in the *_ms fields."""
    m = RequestMetrics.from_timestamps(start_s, token_times_s, n_prompt_tokens)
    tpot = None if m.tpot_ms is None else m.tpot_ms / 1e3
    return replace(m, ttft_ms=m.ttft_ms / 1e3, e2e_ms=m.e2e_ms / 1e3, tpot_ms=tpot,  # MISTAKE: no · 1000
                   itl_ms=tuple(t / 1e3 for t in m.itl_ms))


@mistake("ex09", "RequestMetrics.from_timestamps", "test_throughputs")
def output_throughput_over_decode_time(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                                       peak_bandwidth=None):
    """Output throughput divides by the decode time (e2e - TTFT) instead of the whole request."""
    m = RequestMetrics.from_timestamps(start_s, token_times_s, n_prompt_tokens)
    decode_s = (m.e2e_ms - m.ttft_ms) / 1e3
    return replace(m, output_throughput_tok_s=m.n_output_tokens / decode_s if decode_s else INF)  # MISTAKE


@mistake("ex09", "RequestMetrics.from_timestamps", "test_bad_timestamps_are_refused")
def metrics_skip_the_promised_errors(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                                     peak_bandwidth=None):
    """Computes the metrics of any timestamps: decreasing times give a negative ITL, none an IndexError."""
    t = [float(x) for x in token_times_s]  # MISTAKE: no ValueError for [], decreasing times, t_1 < start
    itl = tuple((b - a) * 1e3 for a, b in zip(t, t[1:]))
    ttft, e2e = (t[0] - start_s) * 1e3, (t[-1] - start_s) * 1e3
    tpot = (e2e - ttft) / (len(t) - 1) if len(t) > 1 else None
    p = (lambda q: percentile(itl, q) if itl else None)
    return cls(n_prompt_tokens, len(t), ttft, tpot, itl, p(50), p(90), p(99), e2e,
               len(t) / (e2e / 1e3) if e2e > 0 else INF, n_prompt_tokens / (ttft / 1e3) if ttft > 0 else INF)


@mistake("ex09", "RequestMetrics.from_timestamps", "test_equal_timestamps_are_fine")
def metrics_refuse_equal_timestamps(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                                    peak_bandwidth=None):
    """Refuses two tokens with the same timestamp (<= instead of <): a coarse clock fails valid requests."""
    t = list(token_times_s)
    if any(b <= a for a, b in zip(t, t[1:])):  # MISTAKE: b < a
        raise ValueError("token_times_s must be increasing")
    return RequestMetrics.from_timestamps(start_s, token_times_s, n_prompt_tokens)


@mistake("ex09", "RequestMetrics.from_timestamps", "test_latencies_by_hand")
def ttft_from_the_clock_origin(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                               peak_bandwidth=None):
    """TTFT and e2e from t = 0 instead of the request start (start_s forgotten)."""
    m = RequestMetrics.from_timestamps(start_s, token_times_s, n_prompt_tokens)
    t = list(token_times_s)
    return replace(m, ttft_ms=t[0] * 1e3, e2e_ms=t[-1] * 1e3)  # MISTAKE: t - start_s


# issue 30: tuples as well as lists, one token, the promised errors checked only in part, the field types


@mistake("ex09", "RequestMetrics.from_timestamps", "test_agrees_with_the_reference_on_any_timestamps")
def metrics_order_checked_against_a_sorted_list(cls, start_s, token_times_s, n_prompt_tokens,
                                                bytes_per_decode_step=None, peak_bandwidth=None):
    """Checks the order with token_times_s != sorted(token_times_s): a tuple never equals a list, so always refused."""
    if not token_times_s or token_times_s != sorted(token_times_s):  # MISTAKE: compare neighbours (a tuple is fine)
        raise ValueError("no tokens or decreasing times")
    return RequestMetrics.from_timestamps(start_s, token_times_s, n_prompt_tokens)


@mistake("ex09", "RequestMetrics.from_timestamps", "test_bad_timestamps_are_refused")
def metrics_order_checked_first_to_last(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                                        peak_bandwidth=None):
    """Refuses only a last token before the first: a time going back in between gives a negative ITL."""
    t = [float(x) for x in token_times_s]
    if not t or t[0] < start_s or t[-1] < t[0]:  # MISTAKE: every neighbour, b < a
        raise ValueError("no tokens, a token before the start or decreasing times")
    itl = tuple((b - a) * 1e3 for a, b in zip(t, t[1:]))
    m = RequestMetrics.from_timestamps(start_s, sorted(t), n_prompt_tokens)
    p = (lambda q: percentile(itl, q) if itl else None)
    return replace(m, itl_ms=itl, itl_p50_ms=p(50), itl_p90_ms=p(90), itl_p99_ms=p(99))


@mistake("ex09", "RequestMetrics.from_timestamps", "test_agrees_with_the_reference_on_any_timestamps")
def metrics_itl_as_a_list(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                          peak_bandwidth=None):
    """itl_ms a list: the dataclass declares a tuple (frozen: a list inside could still be changed)."""
    m = RequestMetrics.from_timestamps(start_s, token_times_s, n_prompt_tokens)
    return replace(m, itl_ms=list(m.itl_ms))  # MISTAKE: tuple(...)


@mistake("ex09", "RequestMetrics.from_timestamps", "test_one_token_has_no_tpot")
def metrics_one_token_tpot_zero(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                                peak_bandwidth=None):
    """A one-token request gets tpot_ms 0.0 (a guard against dividing by 0) instead of None: it had no decode."""
    m = RequestMetrics.from_timestamps(start_s, token_times_s, n_prompt_tokens)
    return replace(m, tpot_ms=0.0) if m.tpot_ms is None else m  # MISTAKE: None


@mistake("ex09", "RequestMetrics.from_timestamps", "test_equal_timestamps_are_fine")
def metrics_zero_ttft_divides_by_zero(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None,
                                      peak_bandwidth=None):
    """prefill throughput = n_prompt / TTFT with no guard: a first token at the start raises ZeroDivisionError."""
    m = RequestMetrics.from_timestamps(start_s, token_times_s, n_prompt_tokens)
    return replace(m, prefill_throughput_tok_s=n_prompt_tokens / (m.ttft_ms / 1e3))  # MISTAKE: inf for 0 ms


# -- ex10 costs ------------------------------------------------------------------------------------


@mistake("ex10", "kv_bytes_per_token", "test_kv_bytes_llama_3_8b")
def kv_bytes_forgets_k_and_v(config, dtype_bytes):
    """Counts K or V, not both: the factor 2 is missing."""
    return config.n_layers * config.n_kv_heads * config.head_dim * dtype_bytes  # MISTAKE: no 2 ·


@mistake("ex10", "kv_bytes_per_token", "test_kv_bytes_llama_3_8b")
def kv_bytes_uses_query_heads(config, dtype_bytes):
    """Uses n_heads instead of n_kv_heads: wrong by n_rep for GQA and MQA models."""
    return 2 * config.n_layers * config.n_heads * config.head_dim * dtype_bytes  # MISTAKE


@mistake("ex10", "kv_bytes_per_token", "test_kv_bytes_with_an_explicit_head_dim")
def kv_bytes_head_dim_from_d_model(config, dtype_bytes):
    """Takes head_dim as d_model // n_heads: wrong for models that set head_dim explicitly."""
    return 2 * config.n_layers * config.n_kv_heads * (config.d_model // config.n_heads) * dtype_bytes  # MISTAKE


@mistake("ex10", "decode_cost", "test_decode_cost_errors")
def decode_cost_accepts_an_empty_context(config, context_len, dtype_bytes, batch_size=1):
    """Computes a cost for context_len 0 or batch_size 0 instead of the promised ValueError."""
    kv = kv_bytes_per_token(config, dtype_bytes) * batch_size  # MISTAKE: no check of context_len, batch_size
    w = weights_bytes(config, dtype_bytes)
    flops = batch_size * flops_per_token(config, context_len)
    return PhaseCost(flops, w + kv * (context_len + 1), w, kv * context_len, kv)


@mistake("ex10", "decode_cost", "test_decode_step_batch_16_reads_the_weights_once")
def decode_reads_weights_per_sequence(config, context_len, dtype_bytes, batch_size=1):
    """Counts the weights once per sequence: batching would not raise the arithmetic intensity."""
    c = decode_cost(config, context_len, dtype_bytes, batch_size)
    w = weights_bytes(config, dtype_bytes) * batch_size  # MISTAKE: read once for the whole batch
    return PhaseCost(c.flops, w + c.kv_read_bytes + c.kv_written_bytes, w, c.kv_read_bytes, c.kv_written_bytes)


@mistake("ex10", "decode_cost", "test_decode_step_batch_1")
def decode_forgets_the_kv_cache(config, context_len, dtype_bytes, batch_size=1):
    """Counts only the weights as bytes: the KV cache reads (and the new entry's write) are left out."""
    w = weights_bytes(config, dtype_bytes)
    return PhaseCost(batch_size * flops_per_token(config, context_len), w, w)  # MISTAKE


# issue 30: documented inputs never tried (sliding windows, the layers that have them), types, promised errors


def _decode(config, context_len, dtype_bytes, batch_size, read, check=True):
    """A decode step whose KV read per layer is read(window, context_len); everything else right."""
    if check and (context_len < 1 or batch_size < 1):
        raise ValueError("context_len < 1 or batch_size < 1")
    per_layer = kv_bytes_per_token(config, dtype_bytes) // config.n_layers * batch_size
    kv_read = per_layer * sum(read(config.window(layer), context_len) for layer in range(config.n_layers))
    w, written = weights_bytes(config, dtype_bytes), per_layer * config.n_layers
    return PhaseCost(float(batch_size * flops_per_token(config, context_len)), float(w + kv_read + written), float(w),
                     float(kv_read), float(written))


@mistake("ex10", "decode_cost", "test_decode_cost_agrees_with_the_reference_on_every_config")
def decode_reads_past_the_window(config, context_len, dtype_bytes, batch_size=1):
    """Reads all context_len positions in every layer: a sliding-window layer reads only the last W."""
    return _decode(config, context_len, dtype_bytes, batch_size, lambda window, n: n)  # MISTAKE: min(n, W)


@mistake("ex10", "decode_cost", "test_decode_cost_agrees_with_the_reference_on_every_config")
def decode_window_on_every_layer(config, context_len, dtype_bytes, batch_size=1):
    """Applies config.sliding_window to every layer, also those sliding_window_layers leaves at full attention."""
    w = config.sliding_window
    return _decode(config, context_len, dtype_bytes, batch_size,
                   lambda window, n: n if w is None else min(n, w))  # MISTAKE: config.window(layer)


@mistake("ex10", "decode_cost", "test_decode_step_batch_1")
def decode_context_len_as_before_the_write(config, context_len, dtype_bytes, batch_size=1):
    """Takes context_len as the cache before the step's write: reads and attends to context_len + 1 positions."""
    c = decode_cost(config, context_len + 1, dtype_bytes, batch_size)  # MISTAKE: context_len is after the write
    if context_len < 1:
        raise ValueError("context_len < 1")
    return c


@mistake("ex10", "decode_cost", "test_decode_cost_errors")
def decode_refuses_only_a_negative_context(config, context_len, dtype_bytes, batch_size=1):
    """Checks context_len < 0 and batch_size < 0: a step with no key at all (or no sequence) gets a cost."""
    if context_len < 0 or batch_size < 0:  # MISTAKE: < 1
        raise ValueError("negative context_len or batch_size")
    return _decode(config, context_len, dtype_bytes, batch_size, lambda w, n: n if w is None else min(n, w),
                   check=False)


@mistake("ex10", "kv_bytes_per_token", "test_kv_bytes_llama_3_8b")
def kv_bytes_scaled_by_the_gqa_ratio(config, dtype_bytes):
    """2 · layers · n_heads · head_dim · dtype_bytes · (n_kv_heads / n_heads): the right number, as a float."""
    return 2 * config.n_layers * config.n_heads * config.head_dim * dtype_bytes * (
        config.n_kv_heads / config.n_heads)  # MISTAKE: an int is documented (bytes are whole)


# -- ex11 prefix cache -----------------------------------------------------------------------------


def _block_hashes(token_ids, block_size, seed, extra_keys=(), hash_fn=hash_block, end=lambda n, size: n - size + 1,
                  parent=lambda hashes, seed: hashes[-1] if hashes else seed,
                  keys=lambda hashes, extra_keys: extra_keys, own_hash=False):
    """block_hashes written plainly: a hash per full block, chained; each knob one of the mistakes below."""
    hashes = []
    for start in range(0, end(len(token_ids), block_size), block_size):
        block = token_ids[start : start + block_size]
        hashes.append((hash_block if own_hash else hash_fn)(parent(hashes, seed), block, keys(hashes, extra_keys)))
    return hashes


def _block_hashes_as(**knobs):
    def block_hashes(token_ids, block_size, seed, extra_keys=(), hash_fn=hash_block):
        return _block_hashes(token_ids, block_size, seed, extra_keys, hash_fn, **knobs)

    return block_hashes


mistakes("ex11", "block_hashes", _block_hashes_as, [
    ("block_hashes_include_partial_block", dict(end=lambda n, size: n), "test_one_hash_per_full_block",
     "Also hashes the last, partial block (its K/V would change as the block fills)."),
    ("block_hashes_not_chained", dict(parent=lambda hashes, seed: seed), "test_one_hash_per_full_block",
     "Hashes each block on its own tokens: equal blocks after different prefixes collide."),
    ("block_hashes_drop_extra_keys", dict(keys=lambda hashes, extra_keys: ()),
     "test_extra_keys_and_hash_fn_are_passed_on",
     "Hashes the tokens only: two LoRA adapters (or images) with the same prompt would share K/V."),
    ("block_hashes_chain_from_the_first_block", dict(parent=lambda hashes, seed: hashes[0] if hashes else seed),
     "test_agrees_with_minillms_prefix_cache",
     "Chains every block to the first block's hash instead of the previous block's."),
    # issue 30: block boundaries, extra keys
    ("block_hashes_miss_a_full_last_block", dict(end=lambda n, size: n - size), "test_hashes_are_chained",
     "Stops before the last block when the prompt is an exact multiple of block_size (range to len - block_size)."),
    ("block_hashes_extra_keys_only_at_the_root", dict(keys=lambda hashes, extra_keys: () if hashes else extra_keys),
     "test_extra_keys_and_hash_fn_are_passed_on",
     "Passes extra_keys to the first block only, as if the chain carried them on (each call must get them)."),
    ("block_hashes_ignore_hash_fn", dict(own_hash=True), "test_extra_keys_and_hash_fn_are_passed_on",
     "Calls hash_block itself, whatever hash_fn was given (a cache built with another hash never hits)."),
])


def _blocks_hit(block_hashes, cached):
    """How many of the hashes are in ``cached``, from the first up to the first miss."""
    n_hit = 0
    for h in block_hashes:
        if h not in cached:
            break
        n_hit += 1
    return n_hit


@mistake("ex11", "longest_cached_prefix", "test_a_partial_block_never_counts")
def prefix_hit_counts_partial_block(block_hashes, cached, n_tokens, block_size):
    """After the full blocks, also counts the leftover tokens of the partial block as cached."""
    n_hit = _blocks_hit(block_hashes, cached)
    leftover = n_tokens - len(block_hashes) * block_size if n_hit == len(block_hashes) else 0  # MISTAKE
    return min(n_hit * block_size + leftover, n_tokens - 1)


@mistake("ex11", "longest_cached_prefix", "test_the_last_token_is_always_prefilled")
def prefix_hit_leaves_no_token_to_prefill(block_hashes, cached, n_tokens, block_size):
    """Serves every cached full block, even the one holding the last prompt token."""
    return _blocks_hit(block_hashes, cached) * block_size  # MISTAKE: at most (n_tokens - 1) // block_size blocks


@mistake("ex11", "longest_cached_prefix", "test_hit_stops_at_the_first_miss")
def prefix_hit_continues_after_a_miss(block_hashes, cached, n_tokens, block_size):
    """Counts every cached block, also those after a missing one."""
    max_blocks = max(n_tokens - 1, 0) // block_size
    return sum(h in cached for h in block_hashes[:max_blocks]) * block_size  # MISTAKE: stop at the first miss


# issue 30: block boundaries, a Container that only answers `in`


@mistake("ex11", "longest_cached_prefix", "test_a_partial_block_never_counts")
def prefix_hit_leaves_a_whole_block(block_hashes, cached, n_tokens, block_size):
    """Always keeps the last full block for the prefill: 9 tokens, both blocks cached gives 4, not 8."""
    n_hit = _blocks_hit(block_hashes[: max(len(block_hashes) - 1, 0)], cached)  # MISTAKE: (n_tokens - 1) // size
    return n_hit * block_size


@mistake("ex11", "longest_cached_prefix", "test_the_last_token_is_always_prefilled")
def prefix_hit_clamped_to_n_minus_1(block_hashes, cached, n_tokens, block_size):
    """min(hit tokens, n_tokens - 1): one token is left, but the result is no longer a whole number of blocks."""
    n_hit = _blocks_hit(block_hashes, cached)
    return max(min(n_hit * block_size, n_tokens - 1), 0)  # MISTAKE: cap the blocks, (n - 1) // block_size


@mistake("ex11", "longest_cached_prefix", "test_agrees_with_minillms_prefix_cache")
def prefix_hit_needs_a_set(block_hashes, cached, n_tokens, block_size):
    """Uses set algebra on `cached` (issuperset): a PrefixCache, which only answers `h in cache`, breaks it."""
    max_blocks = max(n_tokens - 1, 0) // block_size
    for k in range(min(max_blocks, len(block_hashes)), 0, -1):
        if set(cached).issuperset(block_hashes[:k]):  # MISTAKE: `in`, one hash at a time
            return k * block_size
    return 0


# -- ex12 prefill cost, roofline ------------------------------------------------------------------


def _window_read(window, n_tokens, cached):
    """The KV positions a layer reads in a prefill: all of them, or in a window layer the last W of each query's."""
    return cached + n_tokens if window is None else min(cached + n_tokens, n_tokens + window - 1)


def _prefill(config, n_tokens, dtype_bytes, cached_tokens=0, batch_size=1, last_only=True, weights_per_seq=False,
             kv_read_new=True, head_every_token=False, causal=True, flops_per_batch=True, head_dim_from_d_model=False,
             read=None, window=None):
    """minillm's prefill_cost with each of its terms exchangeable (the mistakes below pick wrong ones); a layer's
    KV read is read(its window, n_tokens, cached_tokens) positions, where read is given."""
    if n_tokens < 1 or cached_tokens < 0 or batch_size < 1:
        raise ValueError("n_tokens < 1, cached_tokens < 0 or batch_size < 1")
    if head_dim_from_d_model:
        config = replace(config, head_dim=config.d_model // config.n_heads)
    layer = config.n_layers * (attention_params(config) + mlp_params(config))
    head_tokens = n_tokens if (head_every_token or not last_only) else 1
    flops = 2 * layer * n_tokens + 2 * lm_head_params(config) * head_tokens + attention_flops(
        config, n_tokens, cached_tokens, causal)
    kv = kv_bytes_per_token(config, dtype_bytes) * batch_size
    w = weights_bytes(config, dtype_bytes) * (batch_size if weights_per_seq else 1)
    if read is None:
        kv_read = kv * (cached_tokens + (n_tokens if kv_read_new else 0))
    else:
        window = window or (lambda config, layer: config.window(layer))
        kv_read = kv // config.n_layers * sum(read(window(config, layer), n_tokens, cached_tokens)
                                              for layer in range(config.n_layers))
    written = kv * n_tokens
    flops = flops * (batch_size if flops_per_batch else 1)
    return PhaseCost(float(flops), float(w + kv_read + written), float(w), float(kv_read), float(written))


def _prefill_cost_as(**knobs):
    def prefill_cost(config, n_tokens, dtype_bytes, cached_tokens=0, batch_size=1, last_only=True):
        return _prefill(config, n_tokens, dtype_bytes, cached_tokens, batch_size, last_only, **knobs)

    return prefill_cost


mistakes("ex12", "prefill_cost", _prefill_cost_as, [
    ("prefill_reads_weights_per_sequence", dict(weights_per_seq=True), "test_prefill_onto_a_long_cache_for_a_batch",
     "Counts the weights once per sequence of the batch: they are read once for all of them."),
    ("prefill_kv_read_only_the_cached_part", dict(kv_read_new=False), "test_prefill_of_a_long_prompt",
     "KV read = cached_tokens positions only: attention also reads the new entries it just wrote."),
    ("prefill_ignores_last_only", dict(head_every_token=True), "test_prefill_of_a_long_prompt",
     "Runs the LM head on every prompt token even with last_only=True (only the last one's logits are used)."),
    ("prefill_attention_counts_the_whole_rectangle", dict(causal=False), "test_prefill_of_a_long_prompt",
     "Counts every query-key pair, masked ones included: causal attention does about half."),
    ("prefill_flops_of_one_sequence", dict(flops_per_batch=False), "test_prefill_onto_a_long_cache_for_a_batch",
     "Forgets to multiply the FLOPs by batch_size (every sequence does its own arithmetic)."),
    ("prefill_head_dim_from_d_model", dict(head_dim_from_d_model=True),
     "test_prefill_every_position_with_an_explicit_head_dim",
     "Takes head_dim as d_model // n_heads: wrong for models with an explicit head_dim (Gemma, Qwen3)."),
    # issue 30: sliding windows never tried (the issue's Mistral-7B example)
    ("prefill_kv_read_ignores_the_window", dict(read=lambda w, n, cached: cached + n),
     "test_mistral_decode_at_32k_reads_only_its_window",
     "Reads cached_tokens + n_tokens positions in every layer: Mistral-7B at 32k reads 18.8 GB a step, not 15.0."),
    ("prefill_window_reads_w_positions",
     dict(read=lambda w, n, cached: cached + n if w is None else min(cached + n, w)),
     "test_prefill_cost_agrees_with_the_reference_on_every_config",
     "A window layer reads min(total, W) positions: right for one token, too few for a prefill of several."),
    ("prefill_window_on_every_layer", dict(read=_window_read, window=lambda config, layer: config.sliding_window),
     "test_prefill_cost_agrees_with_the_reference_on_every_config",
     "Uses config.sliding_window in every layer, also those sliding_window_layers leaves at full attention."),
])


def _roofline(cost, time_s, hw, floor=max, overhead=True, fraction=lambda floor_s, t: floor_s / t, compute_bound=None,
              at_the_factor=False):
    if time_s <= 0:
        raise ValueError("time_s must be > 0")
    compute_s, memory_s = cost.flops / hw.peak_flops, cost.bytes / hw.mem_bandwidth
    floor_s = floor(compute_s, memory_s)
    compute = floor_s == compute_s if compute_bound is None else compute_bound(compute_s, memory_s, cost)
    bound = "compute-bound" if compute else "memory-bound"
    if overhead and (time_s >= OVERHEAD_FACTOR * floor_s if at_the_factor else time_s > OVERHEAD_FACTOR * floor_s):
        bound = "overhead-bound"
    return Roofline(time_s, cost.arithmetic_intensity, compute_s, memory_s, floor_s, cost.flops / time_s,
                    cost.bytes / time_s, fraction(floor_s, time_s), bound, "")


def _roofline_as(**knobs):
    def roofline(cost, time_s, hw):
        return _roofline(cost, time_s, hw, **knobs)

    return roofline


mistakes("ex12", "roofline", _roofline_as, [
    ("roofline_smaller_floor_binds", dict(floor=min), "test_verdicts_by_hand",
     "Takes the smaller floor as the limit: the phase could then beat the other floor."),
    ("roofline_never_overhead_bound", dict(overhead=False), "test_verdicts_by_hand",
     "Always blames compute or memory, even when the time is many floors away from either."),
    ("roofline_fraction_inverted", dict(fraction=lambda floor_s, t: t / floor_s), "test_verdicts_by_hand",
     "roofline_fraction = time / floor (>= 1) instead of floor / time (1 = at the roof)."),
    ("roofline_bound_from_intensity_above_1",
     dict(compute_bound=lambda compute_s, memory_s, cost: cost.arithmetic_intensity > 1),
     "test_prefill_is_compute_bound_and_decode_memory_bound",
     "Calls a phase compute-bound when it does more than 1 FLOP per byte, not more than the ridge point."),
    # issue 30: the verdict at the ridge and at the factor
    ("roofline_tie_is_memory_bound", dict(compute_bound=lambda compute_s, memory_s, cost: compute_s > memory_s),
     "test_roofline_agrees_with_the_reference_at_and_near_the_ridge",
     "compute_s > memory_s for compute-bound: at the ridge point (equal floors) says memory-bound."),
    ("roofline_overhead_at_the_factor", dict(at_the_factor=True),
     "test_roofline_agrees_with_the_reference_at_and_near_the_ridge",
     "time_s >= OVERHEAD_FACTOR × floor is overhead-bound: the docstring says only a time that exceeds it."),
    ("roofline_floor_is_the_sum", dict(floor=lambda compute_s, memory_s: compute_s + memory_s), "test_verdicts_by_hand",
     "floor = compute floor + memory floor, as if the GPU could not compute while it loads."),
])


# -- ex13 percentiles, SLOs, goodput ---------------------------------------------------------------


def _meets(m, ttft_ms, tpot_ms):
    return (ttft_ms is None or m.ttft_ms <= ttft_ms) and (tpot_ms is None or m.tpot_ms is None or m.tpot_ms <= tpot_ms)


@mistake("ex13", "percentile", "test_percentile_by_hand")
def percentile_nearest_rank(values, p):
    """Rounds the rank to the nearest value instead of interpolating between the two neighbours."""
    v = sorted(values)
    if not v or not 0 <= p <= 100:
        raise ValueError("no values or p outside [0, 100]")
    return float(v[round((len(v) - 1) * p / 100)])  # MISTAKE: interpolate between floor and ceil


@mistake("ex13", "percentile", "test_percentile_by_hand")
def percentile_of_unsorted_values(values, p):
    """Interpolates between ranks of the values as given, without sorting them first."""
    v = list(values)  # MISTAKE: sorted(values)
    if not v or not 0 <= p <= 100:
        raise ValueError("no values or p outside [0, 100]")
    r = (len(v) - 1) * p / 100
    lo, hi = math.floor(r), math.ceil(r)
    return v[lo] + (v[hi] - v[lo]) * (r - lo)


@mistake("ex13", "percentile", "test_percentile_by_hand")
def percentile_rank_from_n_not_n_minus_1(values, p):
    """Takes the rank p/100 · n (clamped) instead of p/100 · (n - 1): every percentile is pushed up."""
    v = sorted(values)
    if not v or not 0 <= p <= 100:
        raise ValueError("no values or p outside [0, 100]")
    r = min(len(v) * p / 100, len(v) - 1)  # MISTAKE: (len(v) - 1) * p / 100
    lo, hi = math.floor(r), math.ceil(r)
    return v[lo] + (v[hi] - v[lo]) * (r - lo)


@mistake("ex13", "slo_attainment", "test_slo_attainment_by_hand")
def slo_met_only_strictly_below(metrics_list, ttft_ms=None, tpot_ms=None):
    """Uses < for the SLO: a request exactly on the limit counts as missing it."""
    if not metrics_list:
        raise ValueError("no requests")
    ok = [(ttft_ms is None or m.ttft_ms < ttft_ms)  # MISTAKE: <=
          and (tpot_ms is None or m.tpot_ms is None or m.tpot_ms < tpot_ms) for m in metrics_list]
    return sum(ok) / len(ok)


@mistake("ex13", "slo_attainment", "test_slo_attainment_by_hand")
def slo_one_token_request_misses_tpot(metrics_list, ttft_ms=None, tpot_ms=None):
    """Counts a one-token request (TPOT None) as missing any TPOT SLO."""
    if not metrics_list:
        raise ValueError("no requests")
    ok = [(ttft_ms is None or m.ttft_ms <= ttft_ms)
          and (tpot_ms is None or (m.tpot_ms is not None and m.tpot_ms <= tpot_ms))  # MISTAKE
          for m in metrics_list]
    return sum(ok) / len(ok)


@mistake("ex13", "slo_attainment", "test_slo_attainment_by_hand")
def slo_attainment_in_percent(metrics_list, ttft_ms=None, tpot_ms=None):
    """Returns a percentage (0..100) where the docstring says a fraction (0..1)."""
    if not metrics_list:
        raise ValueError("no requests")
    return 100 * sum(_meets(m, ttft_ms, tpot_ms) for m in metrics_list) / len(metrics_list)  # MISTAKE: 100 *


@mistake("ex13", "slo_attainment", "test_slo_attainment_by_hand")
def slo_each_checked_separately(metrics_list, ttft_ms=None, tpot_ms=None):
    """Averages the TTFT attainment and the TPOT attainment instead of asking both of each request."""
    if not metrics_list:
        raise ValueError("no requests")
    n = len(metrics_list)
    ttft_ok = sum(_meets(m, ttft_ms, None) for m in metrics_list) / n
    tpot_ok = sum(_meets(m, None, tpot_ms) for m in metrics_list) / n
    return (ttft_ok + tpot_ok) / 2  # MISTAKE: per request, both at once


@mistake("ex13", "goodput", "test_goodput_by_hand")
def goodput_counts_every_request(metrics_list, duration_s, ttft_ms=None, tpot_ms=None):
    """Divides every finished request by the duration: that is throughput, not goodput."""
    if not metrics_list or duration_s <= 0:
        raise ValueError("no requests or duration_s <= 0")
    return len(metrics_list) / duration_s  # MISTAKE: only the requests meeting the SLOs


@mistake("ex13", "goodput", "test_goodput_by_hand")
def goodput_without_the_duration(metrics_list, duration_s, ttft_ms=None, tpot_ms=None):
    """Returns the number of good requests, not a rate per second."""
    if not metrics_list or duration_s <= 0:
        raise ValueError("no requests or duration_s <= 0")
    return float(sum(_meets(m, ttft_ms, tpot_ms) for m in metrics_list))  # MISTAKE: / duration_s


# issue 30: the Iterable kinds the signature promises (tuple, generator), inputs left alone, the promised errors


def _interpolate(v, p):
    r = (len(v) - 1) * p / 100
    lo, hi = math.floor(r), math.ceil(r)
    return float(v[lo] + (v[hi] - v[lo]) * (r - lo))


@mistake("ex13", "percentile", "test_one_value_is_every_percentile")
def percentile_sorts_in_place(values, p):
    """values.sort(): reorders the caller's list, and a tuple (RequestMetrics.itl_ms) or a generator has no sort."""
    if not 0 <= p <= 100:
        raise ValueError("p outside [0, 100]")
    values.sort()  # MISTAKE: v = sorted(values), a new list
    if not values:
        raise ValueError("no values")
    return _interpolate(values, p)


@mistake("ex13", "percentile", "test_percentile_agrees_with_the_reference_on_every_iterable")
def percentile_len_of_the_iterable(values, p):
    """Takes len(values) of the argument: a generator has no len (the Iterable of the signature)."""
    if not values or not 0 <= p <= 100:
        raise ValueError("no values or p outside [0, 100]")
    r = (len(values) - 1) * p / 100  # MISTAKE: len of the sorted list
    v = sorted(values)
    lo, hi = math.floor(r), math.ceil(r)
    return float(v[lo] + (v[hi] - v[lo]) * (r - lo))


@mistake("ex13", "percentile", "test_percentile_agrees_with_the_reference_on_every_iterable")
def percentile_empty_checked_before_listing(values, p):
    """`if not values` on the argument: an empty generator is truthy, so an IndexError instead of the ValueError."""
    if not values or not 0 <= p <= 100:  # MISTAKE: check the list made from values
        raise ValueError("no values or p outside [0, 100]")
    return _interpolate(sorted(values), p)


@mistake("ex13", "percentile", "test_percentile_errors")
def percentile_p_not_checked(values, p):
    """No ValueError for p outside [0, 100]: p = 101 indexes past the end, p = -1 wraps to the last value."""
    v = sorted(values)
    if not v:
        raise ValueError("no values")
    return _interpolate(v, p)  # MISTAKE: refuse p < 0 or p > 100 first


@mistake("ex13", "percentile", "test_one_value_is_every_percentile")
def percentile_of_one_value_as_given(values, p):
    """`if len(v) == 1: return v[0]`: a single int comes back an int, where every other percentile is a float."""
    v = sorted(values)
    if not v or not 0 <= p <= 100:
        raise ValueError("no values, or p outside [0, 100]")
    if len(v) == 1:
        return v[0]  # MISTAKE: float(v[0])
    return _interpolate(v, p)


@mistake("ex13", "slo_attainment", "test_slo_errors")
def slo_attainment_of_no_requests_is_1(metrics_list, ttft_ms=None, tpot_ms=None):
    """Returns 1.0 for an empty list (no request missed) instead of the promised ValueError."""
    if not metrics_list:
        return 1.0  # MISTAKE: raise ValueError
    return sum(_meets(m, ttft_ms, tpot_ms) for m in metrics_list) / len(metrics_list)


@mistake("ex13", "goodput", "test_slo_errors")
def goodput_zero_duration_divides(metrics_list, duration_s, ttft_ms=None, tpot_ms=None):
    """Refuses only a negative duration: 0 s gives ZeroDivisionError, not the promised ValueError."""
    if not metrics_list or duration_s < 0:  # MISTAKE: <= 0
        raise ValueError("no requests or negative duration_s")
    return sum(_meets(m, ttft_ms, tpot_ms) for m in metrics_list) / duration_s


# -- ex14 the generate loop ------------------------------------------------------------------------


def _generate(model, prompt_ids, params, cache, eos_token_ids, decode_last=False, yield_eos=True, stop_ids=True,
              check_room=True, first_phase="prefill", seeded=True, extra_tokens=0, generator_every_step=False,
              item=True, logprob_item=True, stamp_before=False, order=("eos", "stop", "length", "cache_full"),
              prefill_tokens=None):
    """The loop of the stub's docstring with its decisions exchangeable (the mistakes below make wrong ones)."""
    generator = params.make_generator(cache.k.device) if seeded else None
    stamp = time.perf_counter()
    logits = prefill(model, prompt_ids, cache)
    phase = first_phase
    max_tokens = params.max_new_tokens + extra_tokens
    for n in range(1, max_tokens + 1):
        if generator_every_step:
            generator = params.make_generator(cache.k.device)
        token, logprob = sample(logits, params, generator)
        applies = {"eos": int(token) in eos_token_ids, "stop": stop_ids and int(token) in params.stop_token_ids,
                   "length": n >= max_tokens, "cache_full": check_room and cache.length >= cache.max_seq_len}
        reason = next((r for r in order if applies[r]), None)
        if reason == "eos" and not yield_eos:
            return
        step = GenerationStep(token.item() if item else token, logprob.item() if logprob_item else logprob, phase,
                              cache.length, stamp if stamp_before else time.perf_counter(), reason,
                              prefill_tokens=len(prompt_ids) if prefill_tokens is None else prefill_tokens(cache))
        if reason and decode_last:
            decode_step(model, token, cache)
        yield step
        if reason:
            return
        stamp = time.perf_counter()
        logits = decode_step(model, token, cache)
        phase = "decode"


def _generate_as(**knobs):
    def generate(model, prompt_ids, params, cache, eos_token_ids):
        return _generate(model, prompt_ids, params, cache, eos_token_ids, **knobs)

    return generate


mistakes("ex14", "generate", _generate_as, [
    ("generate_decodes_the_last_token", dict(decode_last=True), "test_greedy_to_max_new_tokens",
     "Runs decode_step on the last token too: a wasted pass, and a full cache raises CacheFullError."),
    ("generate_swallows_the_eos_token", dict(yield_eos=False), "test_stops_at_eos_and_yields_it",
     "Stops on EOS without yielding it: the caller never sees finish_reason 'eos'."),
    ("generate_ignores_stop_token_ids", dict(stop_ids=False), "test_stops_at_a_stop_token_id",
     "Only EOS ids end generation; params.stop_token_ids are never looked at."),
    ("generate_never_checks_the_cache", dict(check_room=False), "test_a_full_cache_ends_the_request",
     "No 'cache_full' stop: decode_step raises CacheFullError once the cache is full."),
    ("generate_first_step_labelled_decode", dict(first_phase="decode"), "test_greedy_to_max_new_tokens",
     "Every step says phase 'decode', the first one too (it comes from the prefill's logits)."),
    ("generate_samples_without_the_seeded_generator", dict(seeded=False), "test_seeded_sampling_matches",
     "Calls sample(logits, params) without the generator: a seed no longer repeats a run."),
    ("generate_makes_a_generator_every_step", dict(generator_every_step=True), "test_seeded_sampling_matches",
     "params.make_generator(...) inside the loop: each token reseeded, every draw the seed's first number."),
    ("generate_one_token_too_many", dict(extra_tokens=1), "test_greedy_to_max_new_tokens",
     "Loops to max_new_tokens + 1 (range(max_new_tokens + 1) counted from 0)."),
    # issue 30: written from the stub alone (types, timing, the order of the stop reasons)
    ("generate_yields_tensor_token_ids", dict(item=False), "test_greedy_to_max_new_tokens",
     "Yields sample's one-element tensor as token_id instead of an int (token.item())."),
    ("generate_yields_tensor_logprobs", dict(logprob_item=False), "test_greedy_to_max_new_tokens",
     "Yields the logprob as a one-element tensor instead of a float (logprob.item())."),
    ("generate_stamps_before_the_forward_pass", dict(stamp_before=True),
     "test_a_token_is_stamped_after_its_forward_pass",
     "Takes a token's time before the pass that produces it: the TTFT leaves out the whole prefill."),
    ("generate_length_before_eos", dict(order=("length", "eos", "stop", "cache_full")),
     "test_agrees_with_the_reference_on_every_prompt_cache_and_stop",
     "Checks the count first: an EOS (or stop id) as the last allowed token is reported as 'length'."),
    ("generate_cache_full_before_length", dict(order=("eos", "stop", "cache_full", "length")),
     "test_agrees_with_the_reference_on_every_prompt_cache_and_stop",
     "Checks the cache before the count: the last allowed token of a full cache is 'cache_full', not 'length'."),
    ("generate_prefill_tokens_counts_the_cache", dict(prefill_tokens=lambda cache: cache.length),
     "test_greedy_to_max_new_tokens",
     "prefill_tokens = cache.length: a cached prefix is counted as prefilled."),
])


# -- ex15 block allocator --------------------------------------------------------------------------


@mistake("ex15", "blocks_needed", "test_blocks_needed_by_hand")
def blocks_needed_floors(num_tokens, block_size):
    """num_tokens // block_size: the partial last block is not counted (17 tokens of 16 get 1 block)."""
    return num_tokens // block_size  # MISTAKE: ceil


@mistake("ex15", "blocks_needed", "test_blocks_needed_by_hand")
def blocks_needed_off_by_one(num_tokens, block_size):
    """num_tokens // block_size + 1: one block too many exactly on a boundary (16 tokens of 16 get 2, 0 get 1)."""
    return num_tokens // block_size + 1  # MISTAKE: (num_tokens + block_size - 1) // block_size


@mistake("ex15", "slot_mapping", "test_slot_mapping_by_hand")
def slot_is_block_id_plus_offset(block_table, start, end, block_size):
    """block_table[p // B] + p % B: the block id is not multiplied by block_size, so blocks overlap."""
    if end > len(block_table) * block_size:
        raise ValueError("position beyond the block table")
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]  # MISTAKE: * block_size


@mistake("ex15", "slot_mapping", "test_slot_mapping_by_hand")
def slot_mapping_restarts_at_the_chunk(block_table, start, end, block_size):
    """Numbers the positions from the chunk's start: a decode at position 16 writes over position 0's slot."""
    if end > len(block_table) * block_size:
        raise ValueError("position beyond the block table")
    return [block_table[i // block_size] * block_size + i % block_size for i in range(end - start)]  # MISTAKE


@mistake("ex15", "slot_mapping", "test_slot_mapping_by_hand")
def slot_mapping_rejects_a_full_table(block_table, start, end, block_size):
    """end >= len(table) * B raises: a table whose last block is exactly full is refused (off by one)."""
    if end >= len(block_table) * block_size:  # MISTAKE: >
        raise ValueError("position beyond the block table")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _allocate_slots(self, request_id, num_tokens, cached_blocks=(), check_first=True, share_first=False,
                    hits_are_free=False, ceil=True):
    """minillm's allocate_slots with its decisions exchangeable (the mistakes below make wrong ones)."""
    cached_blocks = list(cached_blocks)
    if share_first:
        for block_id in cached_blocks:
            self.share_block(block_id)
        self.block_tables.setdefault(request_id, []).extend(cached_blocks)
        cached_blocks = []
    table = self.block_tables.get(request_id, [])
    total = -(-num_tokens // self.block_size) if ceil else num_tokens // self.block_size
    needed = total - len(table) - len(cached_blocks)
    free_hits = 0 if hits_are_free else sum(self.blocks[b].ref_count == 0 for b in cached_blocks)
    if check_first and needed > self.num_free_blocks - free_hits:
        return False
    for block_id in cached_blocks:
        self.share_block(block_id)
    table = self.block_tables.setdefault(request_id, [])
    table.extend(cached_blocks)
    for _ in range(max(needed, 0)):
        if not self.free_queue:
            return False
        table.append(self.allocate_block().block_id)
    return True


def _allocate_slots_as(**knobs):
    def allocate_slots(self, request_id, num_tokens, cached_blocks=()):
        return _allocate_slots(self, request_id, num_tokens, cached_blocks, **knobs)

    return allocate_slots


mistakes("ex15", "BlockAllocator.allocate_slots", _allocate_slots_as, [
    ("allocate_slots_keeps_a_partial_allocation", dict(check_first=False),
     "test_allocate_slots_returns_false_and_changes_nothing",
     "Takes blocks one by one and returns False when the queue runs dry, keeping the blocks it took."),
    ("allocate_slots_shares_hits_before_checking", dict(share_first=True),
     "test_allocate_slots_returns_false_and_changes_nothing",
     "Shares the prefix-cache hits first, then finds the pool short: returns False with their ref counts raised."),
    ("allocate_slots_counts_free_hits_twice", dict(hits_are_free=True), "test_free_cached_hits_are_not_counted_twice",
     "Compares the fresh blocks needed with num_free_blocks, which still counts the free cached hits."),
    ("allocate_slots_forgets_the_partial_block", dict(ceil=False), "test_allocate_slots_at_block_boundaries",
     "num_tokens // block_size blocks: the positions of the partial last block have no slot."),
])


@mistake("ex15", "BlockAllocator.free_block", "test_shared_blocks_are_freed_only_by_their_last_holder")
def free_ignores_ref_count(self, block_id):
    """Every free puts the block back in the free queue: a block another request still reads gets reused."""
    block = self.blocks[block_id]
    if block.ref_count < 1:
        raise RuntimeError(f"block {block_id} freed twice")
    block.ref_count = 0  # MISTAKE: -= 1, and only at 0 into the queue
    self.free_queue[block_id] = None


@mistake("ex15", "BlockAllocator.free_block", "test_a_double_free_raises")
def double_free_not_detected(self, block_id):
    """No check of the count: a second free drives it to -1 and the block is queued twice over."""
    block = self.blocks[block_id]
    block.ref_count -= 1  # MISTAKE: raise RuntimeError when it is already 0
    if block.ref_count <= 0:
        self.free_queue[block_id] = None


@mistake("ex15", "BlockAllocator.free", "test_shared_blocks_are_freed_only_by_their_last_holder")
def free_in_table_order(self, request_id):
    """Frees the table head first: under LRU the shared head (a system prompt) is evicted before the tail."""
    for block_id in self.block_tables.pop(request_id, []):  # MISTAKE: reversed(...)
        self.free_block(block_id)
    self._hashes.pop(request_id, None)


@mistake("ex15", "BlockAllocator.free", "test_shared_blocks_are_freed_only_by_their_last_holder")
def free_skips_shared_blocks(self, request_id):
    """Does not free blocks another request shares: their counts never come back to 0 (a leak)."""
    for block_id in reversed(self.block_tables.pop(request_id, [])):
        if self.blocks[block_id].ref_count == 1:  # MISTAKE: free_block also decrements a shared block
            self.free_block(block_id)
    self._hashes.pop(request_id, None)


# issue 30: written from the stub and the lesson alone; the differential and stateful checks reject them


@mistake("ex15", "blocks_needed", "test_blocks_needed_by_hand")
def blocks_needed_numpy_ceil(num_tokens, block_size):
    """numpy.ceil(num_tokens / block_size): the right count, but a numpy float where an int is promised."""
    import numpy

    return numpy.ceil(num_tokens / block_size)  # MISTAKE: an int, -(-num_tokens // block_size)


@mistake("ex15", "slot_mapping", "test_slot_mapping_beyond_the_table_raises")
def slot_mapping_checks_only_the_start(block_table, start, end, block_size):
    """Checks that start is inside the table, not end: a range running past it raises IndexError, not ValueError."""
    if start >= len(block_table) * block_size:  # MISTAKE: end > len(block_table) * block_size
        raise ValueError("position beyond the block table")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@mistake("ex15", "slot_mapping", "test_slot_mapping_by_hand")
def slot_mapping_returns_a_tensor(block_table, start, end, block_size):
    """Returns torch.tensor(slots) (what the model indexes with) where the docstring promises a list of ints."""
    if end > len(block_table) * block_size:
        raise ValueError("position beyond the block table")
    return torch.tensor([block_table[p // block_size] * block_size + p % block_size  # MISTAKE: a list
                         for p in range(start, end)], dtype=torch.long)


@mistake("ex15", "BlockAllocator.allocate_slots", "test_random_operations_agree_with_minillm")
def allocate_slots_hit_stays_in_the_free_queue(self, request_id, num_tokens, cached_blocks=()):
    """Takes a hit with ref_count += 1, not share_block: a free cached block stays queued and is handed out again."""
    table = self.block_tables.get(request_id, [])
    needed = -(-num_tokens // self.block_size) - len(table) - len(cached_blocks)
    free_hits = sum(self.blocks[b].ref_count == 0 for b in cached_blocks)
    if needed > self.num_free_blocks - free_hits:
        return False
    table = self.block_tables.setdefault(request_id, [])
    for block_id in cached_blocks:
        self.blocks[block_id].ref_count += 1  # MISTAKE: self.share_block(block_id) also takes it off the free queue
        table.append(block_id)
    table.extend(self.allocate_block().block_id for _ in range(max(needed, 0)))
    return True


@mistake("ex15", "BlockAllocator.allocate_slots", "test_allocate_slots_at_block_boundaries")
def allocate_slots_ignores_the_blocks_held(self, request_id, num_tokens, cached_blocks=()):
    """Counts the blocks needed as if the request held none: a growing request gets a whole new set of blocks."""
    needed = -(-num_tokens // self.block_size) - len(cached_blocks)  # MISTAKE: minus the blocks its table holds
    free_hits = sum(self.blocks[b].ref_count == 0 for b in cached_blocks)
    if needed > self.num_free_blocks - free_hits:
        return False
    for block_id in cached_blocks:
        self.share_block(block_id)
    table = self.block_tables.setdefault(request_id, [])
    table.extend(cached_blocks)
    table.extend(self.allocate_block().block_id for _ in range(max(needed, 0)))
    return True


@mistake("ex15", "BlockAllocator.free", "test_random_operations_agree_with_minillm")
def free_unknown_request_raises(self, request_id):
    """block_tables.pop(request_id) with no default: aborting a request still waiting (no blocks) raises KeyError."""
    for block_id in reversed(self.block_tables.pop(request_id)):  # MISTAKE: .pop(request_id, [])
        self.free_block(block_id)
    self._hashes.pop(request_id, None)


@mistake("ex15", "BlockAllocator.free", "test_random_operations_agree_with_minillm")
def free_forgets_the_block_hashes(self, request_id):
    """Frees the blocks but keeps the request's hashes: preempted and started again, its new blocks are never cached."""
    for block_id in reversed(self.block_tables.pop(request_id, [])):
        self.free_block(block_id)
    # MISTAKE: self._hashes.pop(request_id, None)


# -- ex16 scheduler step ---------------------------------------------------------------------------


def _preempt(self, request, batch, free_blocks=True, out_of_batch=True, to_front=True):
    self.running.remove(request)
    if free_blocks:
        self.allocator.free(request.request_id)
    request.status, request.num_computed_tokens = WAITING, 0
    request.num_preemptions += 1
    request.preempted_s.append(time.perf_counter())
    if to_front:
        self.waiting.appendleft(request)
    else:
        self.waiting.append(request)
    if request in batch.requests and out_of_batch:
        i = batch.requests.index(request)
        del batch.requests[i], batch.num_tokens[i]
    batch.preempted.append(request)


def _schedule(self, decodes_first=True, count_decodes=True, cut_to_budget=True, honour_no_chunking=True,
              first_come=True, wait_in_line=True, cap_seqs=True, victim=-1, free_victim=True, use_hits=True,
              victim_out_of_batch=True, hits_without_chunking=True, chunk_what_never_fits=True, stamp_once=True,
              admit_after_preemption=False, victim_to_front=True):
    """minillm's schedule in one piece with its decisions exchangeable (the mistakes below make wrong ones)."""
    batch, budget = ScheduledBatch(), self.max_num_batched_tokens
    left = lambda r: r.num_tokens - r.num_computed_tokens  # noqa: E731

    def run(request, n):  # n of its tokens in this step's batch
        batch.requests.append(request)
        batch.num_tokens.append(n)

    for request in sorted(self.running, key=lambda r: left(r) > 1) if decodes_first else list(self.running):
        if budget <= 0:
            break
        if request.status != RUNNING:
            continue
        n, scheduled = min(left(request), budget), True
        while not self.allocator.allocate_slots(request.request_id, request.num_computed_tokens + n):
            loser = self.running[victim]
            _preempt(self, loser, batch, free_victim, victim_out_of_batch, victim_to_front)
            if loser is request:
                scheduled = False
                break
        if scheduled:
            run(request, n)
            budget -= n if count_decodes or n > 1 else 0
    if batch.preempted and not admit_after_preemption:
        return batch
    for request in list(self.waiting) if first_come else list(reversed(self.waiting)):
        if budget <= 0 or (cap_seqs and len(self.running) >= self.max_num_seqs):
            break
        use = use_hits and (hits_without_chunking or self.enable_chunked_prefill)
        hits = self.allocator.find_cached_prefix(request.all_token_ids) if use else []
        computed = len(hits) * self.allocator.block_size
        n = request.num_tokens - computed
        never_fits = chunk_what_never_fits and n > self.max_num_batched_tokens
        if n > budget and honour_no_chunking and not self.enable_chunked_prefill and not never_fits:
            if wait_in_line:
                break
            continue
        n = min(n, budget if cut_to_budget else self.max_num_batched_tokens)
        if not self.allocator.allocate_slots(request.request_id, computed + n, hits):
            break
        self.waiting.remove(request)
        request.status, request.num_computed_tokens = RUNNING, computed
        if request.first_scheduled_s is None or not stamp_once:
            request.first_scheduled_s, request.num_cached_tokens = time.perf_counter(), computed
        self.running.append(request)
        run(request, n)
        budget -= n
    return batch


def _schedule_as(**knobs):
    def schedule(self):
        return _schedule(self, **knobs)

    return schedule


mistakes("ex16", "Scheduler.schedule", _schedule_as, [
    ("prefill_before_decodes", dict(decodes_first=False), "test_decodes_are_not_starved_by_a_prefill",
     "Serves the running requests in age order: an old request's long prefill chunk starves the decodes."),
    ("decode_tokens_not_counted_in_budget", dict(count_decodes=False), "test_decodes_are_not_starved_by_a_prefill",
     "Decodes are 'only one token' and not taken off the budget: the step exceeds max_num_batched_tokens."),
    ("chunk_not_cut_to_remaining_budget", dict(cut_to_budget=False), "test_the_docstrings_step",
     "Cuts a prompt to max_num_batched_tokens instead of what the requests before it left of the budget."),
    ("chunks_when_chunked_prefill_is_off", dict(honour_no_chunking=False),
     "test_without_chunked_prefill_a_prompt_waits_for_room",
     "Cuts a prompt to the budget left even with enable_chunked_prefill=False."),
    ("waiting_served_last_in_first_out", dict(first_come=False), "test_the_docstrings_step",
     "Takes waiting requests from the back of the deque (pop() instead of popleft()): the newest starts first."),
    ("later_prompt_overtakes_one_that_does_not_fit", dict(wait_in_line=False),
     "test_without_chunked_prefill_a_prompt_waits_for_room",
     "Without chunking, skips a prompt that does not fit and starts a smaller one behind it: not FCFS."),
    ("max_num_seqs_ignored", dict(cap_seqs=False), "test_max_num_seqs_caps_the_batch",
     "Admits waiting requests while the token budget lasts, however many are running."),
    ("preempts_the_oldest", dict(victim=0), "test_preemption_takes_the_newest_request",
     "Preempts running[0], the request that has done the most work, instead of the newest."),
    ("preempted_blocks_not_freed", dict(free_victim=False), "test_preemption_takes_the_newest_request",
     "Sends the preempted request back to waiting but never frees its blocks: the room never appears."),
    ("prefix_hits_recomputed", dict(use_hits=False), "test_prefix_hits_are_not_recomputed",
     "Never asks find_cached_prefix: a prompt whose first blocks are cached is prefilled in full."),
    # issue 30: from the stub and the lesson alone; the stateful check (random traffic beside minillm's) rejects them
    ("preempted_request_left_in_the_batch", dict(victim_out_of_batch=False),
     "test_a_preempted_request_leaves_the_batch",
     "A victim scheduled earlier in the step stays in the batch: it runs with its blocks freed, no block table."),
    ("prefix_hits_ignored_without_chunking", dict(hits_without_chunking=False),
     "test_prefix_hits_are_taken_without_chunked_prefill_too",
     "Takes the prefix-cache hits only on the chunked path: with chunking off, a cached prompt is prefilled whole."),
    ("recompute_longer_than_the_budget_waits_forever", dict(chunk_what_never_fits=False),
     "test_a_recompute_longer_than_the_budget_does_not_wait_forever",
     "Chunking off, a request that does not fit the budget left always waits: a preempted one grown past the whole "
     "budget never runs again, and blocks everyone behind it."),
    ("first_scheduled_restamped_after_a_preemption", dict(stamp_once=False),
     "test_random_traffic_step_by_step_as_minillm",
     "Sets first_scheduled_s and num_cached_tokens on every start: a preempted request's TTFT clock restarts."),
    ("admits_new_requests_in_a_step_that_preempted", dict(admit_after_preemption=True),
     "test_a_workload_step_by_step_as_minillm",
     "Starts waiting requests even after a preemption: the pool that was just too small is filled again."),
    ("preempted_request_to_the_back_of_the_queue", dict(victim_to_front=False),
     "test_preemption_takes_the_newest_request",
     "Puts a preempted request at the BACK of waiting (append): requests that arrived after it overtake it."),
])


# -- ex17 speculative verification rule -------------------------------------------------------------


def _residual(p, q):
    residual = (p - q).clamp(min=0)
    return residual / residual.sum() if residual.sum() > 0 else p


def _verify(p, q, draft_ids, generator, keep_prob=None, residual=_residual, stop=True, q_none_is_sure=False,
            bonus=True, last_drafts_row=False, count_later=False, u_gen=True, resample_gen=True, bonus_gen=True,
            item=True, row_shift=0):
    """The rule written plainly, with the knobs each mistake turns."""
    def draw(probs, seeded):
        token = torch.multinomial(probs, 1, generator=generator if seeded else None)
        return token.item() if item else token

    n_accepted, first_rejected = 0, None
    for i, d in enumerate(draft_ids):
        q_i = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).to(p)
        prob = p[i + row_shift, d] / q_i[d] if keep_prob is None else keep_prob(p[i, d].item(), q_i[d].item())
        if q is None and q_none_is_sure:
            prob = 1.0
        kept = torch.rand((), generator=generator if u_gen else None, device=p.device) < prob
        if kept and first_rejected is None:
            n_accepted += 1
        elif not kept and first_rejected is None:
            first_rejected = (i, residual(p[i], q_i))
            if stop:
                break
    if first_rejected is not None:
        token = draw(first_rejected[1], resample_gen)
    else:
        token = draw(p[max(len(draft_ids) - 1, 0) if last_drafts_row else -1], bonus_gen)
        if not bonus and draft_ids:
            token = None
    if count_later:  # the later drafts it "keeps": those p's argmax agrees with
        n_accepted += sum(1 for i, d in enumerate(draft_ids[n_accepted + 1:], start=n_accepted + 1)
                          if i < len(p) - 1 and p[i].argmax().item() == d)
    return n_accepted, token


def _verify_as(**knobs):
    def accept_or_resample(p, q, draft_ids, generator=None):
        return _verify(p, q, draft_ids, generator, **knobs)

    return accept_or_resample


mistakes("ex17", "accept_or_resample", _verify_as, [
    ("no_bonus_token", dict(bonus=False), "test_one_hot_p_keeps_drafts_until_the_first_miss",
     "When every draft is kept, returns no token: the pass's free token from p_k is lost."),
    ("bonus_from_the_last_drafts_row", dict(last_drafts_row=True), "test_one_hot_p_keeps_drafts_until_the_first_miss",
     "Draws the bonus token from p_{k-1} (the row that checked the last draft), not p_k."),
    ("accepts_when_p_greater_than_q", dict(keep_prob=lambda pd, qd: 1.0 if pd > qd else 0.0),
     "test_one_hot_p_keeps_drafts_until_the_first_miss",
     "Keeps a draft only when p(d) > q(d), deterministically, instead of with probability p(d)/q(d)."),
    ("accepts_with_q_over_p", dict(keep_prob=lambda pd, qd: min(1.0, qd / pd) if pd else 1.0),
     "test_one_hot_p_keeps_drafts_until_the_first_miss",
     "The ratio upside down: keeps d with probability min(1, q(d)/p(d))."),
    ("resamples_from_p_not_the_residual", dict(residual=lambda p_i, q_i: p_i),
     "test_a_draft_is_kept_with_probability_p_over_q",
     "At a rejection draws the replacement from p_i: the rejected draft's mass is counted twice."),
    ("keeps_checking_after_a_rejection", dict(stop=False, count_later=True),
     "test_one_hot_p_keeps_drafts_until_the_first_miss",
     "Goes on testing the drafts after the first rejection and counts the later ones it keeps."),
    ("deterministic_draft_always_accepted", dict(q_none_is_sure=True),
     "test_one_hot_p_keeps_drafts_until_the_first_miss",
     "With q None (prompt lookup) keeps every draft, as if a sure guess needed no check."),
    # issue 30: written from the stub alone (the seed, types, rows)
    ("accept_test_draws_from_the_global_rng", dict(u_gen=False), "test_the_generator_alone_decides_the_outcome",
     "Draws the accept test's u with torch.rand(()) from the global RNG: a seeded run does not repeat."),
    ("resample_draws_from_the_global_rng", dict(resample_gen=False), "test_the_generator_alone_decides_the_outcome",
     "Draws a rejected draft's replacement with torch.multinomial(residual, 1) from the global RNG."),
    ("bonus_draws_from_the_global_rng", dict(bonus_gen=False), "test_the_generator_alone_decides_the_outcome",
     "Draws the bonus token with torch.multinomial(p[-1], 1) from the global RNG."),
    ("token_as_a_tensor", dict(item=False), "test_accept_or_resample_follows_the_rule_on_random_distributions",
     "Returns torch.multinomial's [1] tensor as the token, not an int (.item())."),
    ("draft_checked_against_the_next_row", dict(row_shift=1), "test_one_hot_p_keeps_drafts_until_the_first_miss",
     "Tests draft i against p[i + 1] (the row after it) instead of p[i], the row that scored it."),
])


@mistake("ex17", "residual_distribution", "test_residual_by_hand")
def residual_not_normalised(p, q):
    """Returns max(0, p - q) without dividing by its sum: not a distribution."""
    return (p - q).clamp(min=0)  # MISTAKE


@mistake("ex17", "residual_distribution", "test_residual_by_hand")
def residual_without_the_max(p, q):
    """Normalises p - q itself: tokens the draft over-proposed get negative weight."""
    return (p - q) / (p - q).sum() if (p - q).sum() > 0 else p  # MISTAKE


# issue 30: p == q


@mistake("ex17", "residual_distribution", "test_residual_by_hand")
def residual_nan_when_p_equals_q(p, q):
    """Divides max(0, p - q) by its sum even when it is 0 (p == q): NaN instead of p."""
    residual = (p - q).clamp(min=0)
    return residual / residual.sum()  # MISTAKE: p when the sum is 0


@mistake("ex17", "residual_distribution", "test_residual_by_hand")
def residual_p_only_when_exactly_equal(p, q):
    """`if torch.equal(p, q): return p`: a q a rounding step above p leaves nothing either, and 0 / 0 is NaN."""
    if torch.equal(p, q):  # MISTAKE: p whenever the sum of max(0, p - q) is 0
        return p
    residual = (p - q).clamp(min=0)
    return residual / residual.sum()


# -- ex18 int4 group quantisation ------------------------------------------------------------------


def _int4_groups(w, group_size):
    pad = -w.shape[1] % group_size
    return torch.nn.functional.pad(w.float(), (0, pad)).view(w.shape[0], -1, group_size)


def _int4_codes(w, group_size, scale, zero):
    groups = _int4_groups(w, group_size)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_int4(q.view(w.shape[0], -1)[:, :w.shape[1]])


@mistake("ex18", "quantize_int4", "test_codes_by_hand")
def int4_symmetric(w, group_size=64):
    """Symmetric int4 (scale = max|w| / 7, zero fixed at 8): half the codes wasted on a one-sided group."""
    groups = _int4_groups(w, group_size)
    scale = groups.abs().amax(-1) / 7  # MISTAKE: (hi - lo) / 15 with a zero point
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.full_like(scale, 8)
    return _int4_codes(w, group_size, scale, zero), scale, zero.to(torch.uint8)


@mistake("ex18", "quantize_int4", "test_codes_by_hand")
def int4_scale_from_max(w, group_size=64):
    """scale = max / 15, not (max - min) / 15: the negative part of the range is clipped to code 0."""
    groups = _int4_groups(w, group_size)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = hi / 15  # MISTAKE: (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    return _int4_codes(w, group_size, scale, zero), scale, zero.to(torch.uint8)


@mistake("ex18", "quantize_int4", "test_scales_of_one_sided_groups")
def int4_range_without_zero(w, group_size=64):
    """lo = min w, hi = max w: a one-sided group's range stops short of 0 ([0.1, 3.0]: scale 2.9 / 15, not 3 / 15)."""
    if group_size < 2:
        raise QuantizationError("group_size < 2")
    pad = -w.shape[1] % group_size
    groups = torch.nn.functional.pad(w.float(), (0, pad), value=math.nan).view(w.shape[0], -1, group_size)
    lo, hi = groups.nan_to_num(INF).amin(-1), groups.nan_to_num(-INF).amax(-1)  # MISTAKE: min(0, .), max(0, .)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    return _int4_codes(w, group_size, scale, zero), scale, zero.to(torch.uint8)


@mistake("ex18", "quantize_int4", "test_codes_by_hand")
def int4_nibble_order_swapped(w, group_size=64):
    """The earlier element in the high nibble: q[2j] << 4 | q[2j+1], unreadable by every int4 kernel."""
    packed, scale, zero = quantize_int4(w, group_size)
    return (packed << 4) | (packed >> 4), scale, zero  # MISTAKE: swaps the two nibbles of each byte


@mistake("ex18", "quantize_int4", "test_short_last_group")
def int4_forgets_the_short_group(w, group_size=64):
    """n_groups = in // group_size: the last weights of a row that does not divide evenly get no group."""
    full = w.shape[1] // group_size * group_size  # MISTAKE: ceil, the short group counts
    packed, scale, zero = quantize_int4(w[:, :full], group_size)
    return torch.cat([packed, torch.zeros(w.shape[0], -(-w.shape[1] // 2) - packed.shape[1], dtype=torch.uint8)], 1), \
        scale, zero


@mistake("ex18", "dequantize_int4", "test_round_trip_within_half_a_step")
def int4_dequantize_forgets_the_zero(packed, scale, zero, in_features, group_size=64):
    """ŵ = q · scale: the zero point is not subtracted, every weight shifted by zero · scale."""
    return dequantize_int4(packed, scale, torch.zeros_like(zero), in_features, group_size)  # MISTAKE: (q - zero)


# issue 30: odd in_features, group sizes below 2, half-precision weights, flat groups, rounding, the padding nibble


def _int4_in(w, group_size, dtype):
    """minillm's int4 codes computed in ``dtype`` (unpacked q [out, in] uint8, scale, zero of that dtype)."""
    out, n_in = w.shape
    groups = _int4_groups(w.to(dtype), group_size).to(dtype)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view(out, -1)[:, :n_in], scale, zero


@mistake("ex18", "quantize_int4", "test_quantize_agrees_with_the_reference_on_every_shape_and_dtype")
def int4_pack_with_view(w, group_size=64):
    """Packs with q.view(out, -1, 2): crashes on an odd in_features, which the docstring allows (ceil(in/2))."""
    if group_size < 2:
        raise QuantizationError("group_size < 2")
    q, scale, zero = _int4_in(w, group_size, torch.float32)
    pairs = q.view(q.shape[0], -1, 2)  # MISTAKE: pad an odd row with a 0 code first
    return (pairs[..., 0] | pairs[..., 1] << 4).contiguous(), scale, zero.to(torch.uint8)


@mistake("ex18", "quantize_int4", "test_quantize_agrees_with_the_reference_on_every_shape_and_dtype")
def int4_without_upcasting(w, group_size=64):
    """Quantises bfloat16/float16 weights in their own dtype: the scale and w / scale round, error > scale / 2."""
    if group_size < 2:
        raise QuantizationError("group_size < 2")
    q, scale, zero = _int4_in(w, group_size, w.dtype)  # MISTAKE: w.float() first
    return pack_int4(q), scale.float(), zero.to(torch.uint8)


@mistake("ex18", "quantize_int4", "test_quantize_agrees_with_the_reference_on_every_shape_and_dtype")
def int4_group_size_not_checked(w, group_size=64):
    """No QuantizationError for group_size < 2: 1 gives 5 bytes of scale and zero per weight, 0 a ZeroDivisionError."""
    q, scale, zero = _int4_in(w, group_size, torch.float32)  # MISTAKE: refuse group_size < 2 first
    return pack_int4(q), scale, zero.to(torch.uint8)


@mistake("ex18", "quantize_int4", "test_quantize_agrees_with_the_reference_on_every_shape_and_dtype")
def int4_zero_group_gives_nan(w, group_size=64):
    """scale = (hi - lo) / 15 with no guard: an all-zero group gets scale 0, and 0 / 0 codes."""
    if group_size < 2:
        raise QuantizationError("group_size < 2")
    groups = _int4_groups(w, group_size)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = (hi - lo) / 15  # MISTAKE: 1 where hi == lo
    zero = torch.round(-lo / scale).nan_to_num(0).clamp(0, 15)
    return _int4_codes(w, group_size, scale, zero), scale, zero.to(torch.uint8)


@mistake("ex18", "quantize_int4", "test_constant_and_zero_groups_come_back_exactly")
def int4_truncates_instead_of_rounding(w, group_size=64):
    """q = (w / scale + zero) cast to uint8: truncation, an error up to a whole step instead of half."""
    if group_size < 2:
        raise QuantizationError("group_size < 2")
    _, scale, zero = quantize_int4(w, group_size)
    groups = _int4_groups(w, group_size)
    q = (groups / scale[..., None] + zero[..., None].float()).clamp(0, 15).to(torch.uint8)  # MISTAKE: round
    return pack_int4(q.view(w.shape[0], -1)[:, :w.shape[1]]), scale, zero


@mistake("ex18", "dequantize_int4", "test_round_trip_within_half_a_step_on_every_dtype")
def int4_dequantize_keeps_the_padding_nibble(packed, scale, zero, in_features, group_size=64):
    """Returns every nibble, 2 · bytes columns: an odd in_features gets the padding code as an extra weight."""
    return dequantize_int4(packed, scale, zero, 2 * packed.shape[1], group_size)  # MISTAKE: cut to in_features


# -- ex19 disaggregation: the K/V transfer against the prefill (issue 30) ----------------------------

from minillm.costs import prefill_cost as _prefill_cost  # noqa: E402
from minillm.whatif import transfer_vs_prefill as _transfer_vs_prefill  # noqa: E402


def _kv_transfer_checked(prompt_tokens, dtype_bytes, link_gbit_s):
    if prompt_tokens < 0 or dtype_bytes < 1 or not link_gbit_s > 0:
        raise ValueError("bad input")


@mistake("ex19", "kv_transfer_seconds", "test_llama_3_8b_over_infiniband")
def transfer_link_speed_in_bytes(config, prompt_tokens, dtype_bytes, link_gbit_s):
    """bytes / (link_gbit_s · 1e9): the link's Gb/s taken as GB/s, the transfer 8x too fast."""
    _kv_transfer_checked(prompt_tokens, dtype_bytes, link_gbit_s)
    return prompt_tokens * kv_bytes_per_token(config, dtype_bytes) / (link_gbit_s * 1e9)  # MISTAKE: bits, / 8


@mistake("ex19", "kv_transfer_seconds", "test_llama_3_8b_over_infiniband")
def transfer_forgets_k_and_v(config, prompt_tokens, dtype_bytes, link_gbit_s):
    """n_layers · n_kv_heads · head_dim · dtype_bytes per token: only K (or only V) is sent, half the bytes."""
    _kv_transfer_checked(prompt_tokens, dtype_bytes, link_gbit_s)
    per_token = config.n_layers * config.n_kv_heads * config.head_dim * dtype_bytes  # MISTAKE: 2 · (K and V)
    return prompt_tokens * per_token / (link_gbit_s * 1e9 / 8)


@mistake("ex19", "kv_transfer_seconds", "test_llama_3_8b_over_infiniband")
def transfer_uses_query_heads(config, prompt_tokens, dtype_bytes, link_gbit_s):
    """2 · n_layers · n_heads · head_dim: the query heads counted, GQA's smaller cache forgotten."""
    _kv_transfer_checked(prompt_tokens, dtype_bytes, link_gbit_s)
    per_token = 2 * config.n_layers * config.n_heads * config.head_dim * dtype_bytes  # MISTAKE: n_kv_heads
    return prompt_tokens * per_token / (link_gbit_s * 1e9 / 8)


@mistake("ex19", "kv_transfer_seconds", "test_llama_3_8b_over_infiniband")
def transfer_ignores_layers(config, prompt_tokens, dtype_bytes, link_gbit_s):
    """2 · n_kv_heads · head_dim · dtype_bytes: one layer's K/V, as if the decode worker needed no other."""
    _kv_transfer_checked(prompt_tokens, dtype_bytes, link_gbit_s)
    per_token = 2 * config.n_kv_heads * config.head_dim * dtype_bytes  # MISTAKE: · n_layers
    return prompt_tokens * per_token / (link_gbit_s * 1e9 / 8)


@mistake("ex19", "kv_transfer_seconds", "test_only_the_kv_heads_of_every_layer_cross")
def transfer_head_dim_from_d_model(config, prompt_tokens, dtype_bytes, link_gbit_s):
    """head_dim = d_model // n_heads: wrong for models that set head_dim (Qwen3, Gemma)."""
    _kv_transfer_checked(prompt_tokens, dtype_bytes, link_gbit_s)
    head_dim = config.d_model // config.n_heads  # MISTAKE: config.head_dim
    return prompt_tokens * 2 * config.n_layers * config.n_kv_heads * head_dim * dtype_bytes / (link_gbit_s * 1e9 / 8)


@mistake("ex19", "kv_transfer_seconds", "test_kv_transfer_errors")
def transfer_lets_a_nan_link_through(config, prompt_tokens, dtype_bytes, link_gbit_s):
    """`if link_gbit_s <= 0: raise`: NaN passes that test and the transfer comes out NaN."""
    if prompt_tokens < 0 or dtype_bytes < 1 or link_gbit_s <= 0:  # MISTAKE: not link_gbit_s > 0
        raise ValueError("bad input")
    return prompt_tokens * kv_bytes_per_token(config, dtype_bytes) / (link_gbit_s * 1e9 / 8)


@mistake("ex19", "kv_transfer_seconds", "test_transfer_agrees_with_the_reference")
def transfer_returns_an_int_for_no_tokens(config, prompt_tokens, dtype_bytes, link_gbit_s):
    """`if prompt_tokens == 0: return 0`: the int 0 where a float of seconds is documented."""
    _kv_transfer_checked(prompt_tokens, dtype_bytes, link_gbit_s)
    if prompt_tokens == 0:
        return 0  # MISTAKE: 0.0
    return prompt_tokens * kv_bytes_per_token(config, dtype_bytes) / (link_gbit_s * 1e9 / 8)


def _ratio_transfer(config, prompt_tokens, dtype_bytes, link_gbit_s):
    if prompt_tokens < 1 or dtype_bytes < 1 or not link_gbit_s > 0:
        raise ValueError("bad input")
    return prompt_tokens * kv_bytes_per_token(config, dtype_bytes) / (link_gbit_s * 1e9 / 8)


@mistake("ex19", "transfer_vs_prefill", "test_ratio_of_a_short_memory_bound_prefill")
def ratio_against_the_compute_floor_only(config, prompt_tokens, dtype_bytes, link_gbit_s, hw):
    """prefill = FLOPs / peak_flops: "prefill is compute-bound", wrong for a short prompt (memory-bound)."""
    cost = _prefill_cost(config, max(prompt_tokens, 1), dtype_bytes)
    transfer = _ratio_transfer(config, prompt_tokens, dtype_bytes, link_gbit_s)
    return transfer / (cost.flops / hw.peak_flops)  # MISTAKE: max(compute floor, memory floor)


@mistake("ex19", "transfer_vs_prefill", "test_ratio_llama_3_8b_on_an_h100")
def ratio_inverted(config, prompt_tokens, dtype_bytes, link_gbit_s, hw):
    """prefill / transfer: the ratio upside down, so a slow link looks like a bargain."""
    return 1 / _transfer_vs_prefill(config, prompt_tokens, dtype_bytes, link_gbit_s, hw)  # MISTAKE: transfer / prefill


@mistake("ex19", "transfer_vs_prefill", "test_ratio_llama_3_8b_on_an_h100")
def ratio_link_speed_in_bytes(config, prompt_tokens, dtype_bytes, link_gbit_s, hw):
    """The transfer worked out inline with the link's Gb/s as GB/s: the ratio 8x too small."""
    return _transfer_vs_prefill(config, prompt_tokens, dtype_bytes, link_gbit_s * 8, hw)  # MISTAKE: bits, / 8


@mistake("ex19", "transfer_vs_prefill", "test_ratio_llama_3_8b_on_an_h100")
def ratio_prefill_runs_the_lm_head_on_every_token(config, prompt_tokens, dtype_bytes, link_gbit_s, hw):
    """prefill FLOPs with the LM head on all P tokens: minillm's prefill (and the docstring's) runs it once."""
    cost = _prefill_cost(config, max(prompt_tokens, 1), dtype_bytes, last_only=False)  # MISTAKE: last_only=True
    transfer = _ratio_transfer(config, prompt_tokens, dtype_bytes, link_gbit_s)
    return transfer / max(cost.flops / hw.peak_flops, cost.bytes / hw.mem_bandwidth)


# -- ex20 speculative speed-up: expected tokens per pass (issue 30) -----------------------------------

from minillm.speculative import expected_tokens_per_pass as _expected_tokens  # noqa: E402


def _spec_checked(a, k):
    if not 0 <= a <= 1 or not isinstance(k, int) or k < 0:
        raise ValueError("bad input")


@mistake("ex20", "expected_tokens_per_pass", "test_the_expected_tokens_of_a_good_draft")
def tokens_per_pass_a_times_k(acceptance_rate, k):
    """E = a · k: the expected accepted drafts if each were kept on its own, no stop at the first rejection."""
    _spec_checked(acceptance_rate, k)
    return float(acceptance_rate * k)  # MISTAKE: 1 + a + ... + a^k


@mistake("ex20", "expected_tokens_per_pass", "test_the_expected_tokens_of_a_good_draft")
def tokens_per_pass_forgets_the_bonus(acceptance_rate, k):
    """E = (1 - a^k) / (1 - a): one token short, k (not k + 1) when every draft is kept."""
    _spec_checked(acceptance_rate, k)
    if acceptance_rate == 1:
        return float(k)  # MISTAKE: k + 1
    return (1 - acceptance_rate ** k) / (1 - acceptance_rate)  # MISTAKE: a^(k+1)


@mistake("ex20", "expected_tokens_per_pass", "test_the_expected_tokens_of_a_good_draft")
def tokens_per_pass_counts_only_accepted_drafts(acceptance_rate, k):
    """E = a + a² + ... + a^k: the accepted drafts, without the token the model adds to every pass."""
    _spec_checked(acceptance_rate, k)
    return _expected_tokens(acceptance_rate, k) - 1  # MISTAKE: the model's own token counts


def _tokens_per_pass(acceptance_rate, k, nan_slips=False, float_k=False, at_1=lambda k: float(k + 1)):
    """expected_tokens_per_pass written plainly, each knob one of the mistakes below (at_1 None: no case for a = 1)."""
    a = acceptance_rate
    if ((a < 0 or a > 1) if nan_slips else not 0 <= a <= 1) or (not float_k and not isinstance(k, int)) or k < 0:
        raise ValueError("bad input")
    if a == 1 and at_1 is not None:
        return at_1(k)
    return (1 - a ** (k + 1)) / (1 - a)


def _expected_tokens_per_pass_as(**knobs):
    def expected_tokens_per_pass(acceptance_rate, k):
        return _tokens_per_pass(acceptance_rate, k, **knobs)

    return expected_tokens_per_pass


mistakes("ex20", "expected_tokens_per_pass", _expected_tokens_per_pass_as, [
    ("tokens_per_pass_divides_by_zero_at_a_1", dict(at_1=None), "test_a_perfect_draft_gives_k_plus_1",
     "(1 - a^(k+1)) / (1 - a) with no case for a = 1: ZeroDivisionError where E = k + 1."),
    ("tokens_per_pass_returns_an_int_at_a_1", dict(at_1=lambda k: k + 1),
     "test_expected_tokens_agree_with_the_reference",
     "`if a == 1: return k + 1`: the int where the docstring promises a float."),
    ("tokens_per_pass_lets_nan_through", dict(nan_slips=True), "test_expected_tokens_errors",
     "`if a < 0 or a > 1: raise`: NaN passes both comparisons and E comes out NaN."),
    ("tokens_per_pass_accepts_a_float_k", dict(float_k=True), "test_expected_tokens_errors",
     "`if k < 0: raise` only: k = 2.0 or 0.5 drafts is taken, though k is an integer."),
])


@mistake("ex20", "expected_tokens_per_pass", "test_expected_tokens_errors")
def tokens_per_pass_a_1_before_the_checks(acceptance_rate, k):
    """`if a == 1: return float(k + 1)` before checking k: k = -1 or 2.0 at a = 1 gives a number, no ValueError."""
    if acceptance_rate == 1:
        return float(k + 1)  # MISTAKE: check k first
    _spec_checked(acceptance_rate, k)
    return _expected_tokens(acceptance_rate, k)


def _speedup_checked(a, k, c, v):
    _spec_checked(a, k)
    if not (math.isfinite(c) and c >= 0 and math.isfinite(v) and v > 0):
        raise ValueError("bad input")


@mistake("ex20", "speculative_speedup", "test_speedup_with_a_draft_model")
def speedup_ignores_the_draft_cost(acceptance_rate, k, draft_cost, verify_cost=1.0):
    """E / verify_cost: the draft's k steps taken as free, a draft model's speed-up overstated."""
    _speedup_checked(acceptance_rate, k, draft_cost, verify_cost)
    return _expected_tokens(acceptance_rate, k) / verify_cost  # MISTAKE: k · draft_cost + verify_cost


@mistake("ex20", "speculative_speedup", "test_speedup_of_prompt_lookup_with_a_costly_verify_pass")
def speedup_ignores_the_verify_cost(acceptance_rate, k, draft_cost, verify_cost=1.0):
    """E / (k · c + 1): Leviathan's one-step verify pass assumed even when a measured cost is given."""
    _speedup_checked(acceptance_rate, k, draft_cost, verify_cost)
    return _expected_tokens(acceptance_rate, k) / (k * draft_cost + 1)  # MISTAKE: + verify_cost


@mistake("ex20", "speculative_speedup", "test_speedup_with_a_draft_model")
def speedup_runs_the_draft_k_plus_1_times(acceptance_rate, k, draft_cost, verify_cost=1.0):
    """E / ((k + 1) · c + v): the draft charged for the bonus token too, which the target makes."""
    _speedup_checked(acceptance_rate, k, draft_cost, verify_cost)
    return _expected_tokens(acceptance_rate, k) / ((k + 1) * draft_cost + verify_cost)  # MISTAKE: k · c


@mistake("ex20", "speculative_speedup", "test_speedup_errors")
def speedup_never_checks_the_costs(acceptance_rate, k, draft_cost, verify_cost=1.0):
    """No check of draft_cost and verify_cost: a negative, zero or NaN cost gives a number, not a ValueError."""
    _spec_checked(acceptance_rate, k)  # MISTAKE: draft_cost >= 0, verify_cost > 0, both finite
    return _expected_tokens(acceptance_rate, k) / (k * draft_cost + verify_cost)


@mistake("ex20", "speculative_speedup", "test_plain_decoding_costs_its_verify_pass")
def speedup_of_no_drafts_is_1(acceptance_rate, k, draft_cost, verify_cost=1.0):
    """`if k == 0: return 1.0`: no drafts taken as no change, though the pass still costs v: plain decoding is 1 / v."""
    _speedup_checked(acceptance_rate, k, draft_cost, verify_cost)
    if k == 0:
        return 1.0  # MISTAKE: 1 / verify_cost
    return _expected_tokens(acceptance_rate, k) / (k * draft_cost + verify_cost)


# -- ex21 tensor parallelism: each rank's shards and the all-reduce bytes (issue 33) -------------------

from minillm.costs import all_reduce_bytes_per_layer as _all_reduce_bytes  # noqa: E402
from minillm.distributed.tensor_parallel import column_shard as _column_shard  # noqa: E402


def _shard_checked(size, rank, world_size, unit):
    if world_size < 1 or not 0 <= rank < world_size or unit < 1 or size % unit or (size // unit) % world_size:
        raise ValueError("bad shard")
    return size // world_size


@mistake("ex21", "column_shard", "test_q_proj_rows_of_each_rank")
def column_shard_rank_off_by_one(weight, rank, world_size, unit=1):
    """Ranks counted from 1: rank r takes the rows of rank r + 1 (the last rank's block runs off the end)."""
    n = _shard_checked(weight.shape[0], rank, world_size, unit)
    return weight[(rank + 1) * n:(rank + 2) * n]  # MISTAKE: rank · n


@mistake("ex21", "column_shard", "test_q_proj_rows_of_each_rank")
def column_shard_splits_the_columns(weight, rank, world_size, unit=1):
    """Splits in_features: a column-parallel layer named after its columns, but it keeps whole output rows."""
    n = _shard_checked(weight.shape[-1], rank, world_size, unit)
    return weight[..., rank * n:(rank + 1) * n]  # MISTAKE: weight[rank · n : (rank + 1) · n]


@mistake("ex21", "column_shard", "test_heads_stay_whole")
def column_shard_cuts_heads(weight, rank, world_size, unit=1):
    """Checks only that the rows split N ways, not the heads: 2 heads over 3 ranks cut each head in pieces."""
    if world_size < 1 or not 0 <= rank < world_size or unit < 1 or weight.shape[0] % world_size:  # MISTAKE: units
        raise ValueError("bad shard")
    n = weight.shape[0] // world_size
    return weight[rank * n:(rank + 1) * n]


@mistake("ex21", "column_shard", "test_q_proj_rows_of_each_rank")
def column_shard_round_robin(weight, rank, world_size, unit=1):
    """Rows r, r + N, r + 2N, ...: every head's dimensions dealt out to all the ranks."""
    _shard_checked(weight.shape[0], rank, world_size, unit)
    return weight[rank::world_size]  # MISTAKE: a contiguous block of whole heads


@mistake("ex21", "column_shard", "test_heads_stay_whole")
def column_shard_without_checks(weight, rank, world_size, unit=1):
    """No check of rank, world_size or the units: a bad rank gives an empty or short slice, not a ValueError."""
    n = weight.shape[0] // max(world_size, 1)  # MISTAKE: ValueError for what does not split
    return weight[rank * n:(rank + 1) * n]


@mistake("ex21", "row_shard", "test_o_proj_columns_of_each_rank")
def row_shard_splits_the_rows(weight, rank, world_size, unit=1):
    """Splits out_features like column_shard: o_proj's output rows, so each rank's sum covers part of d_model."""
    if weight.dim() != 2:
        raise ValueError("2-D")
    return _column_shard(weight, rank, world_size, unit)  # MISTAKE: weight[:, columns]


@mistake("ex21", "row_shard", "test_o_proj_columns_of_each_rank")
def row_shard_takes_the_other_ranks_columns(weight, rank, world_size, unit=1):
    """Rank r takes rank N-1-r's columns: they no longer read the heads rank r computed."""
    if weight.dim() != 2:
        raise ValueError("2-D")
    n = _shard_checked(weight.shape[1], rank, world_size, unit)
    other = world_size - 1 - rank  # MISTAKE: rank
    return weight[:, other * n:(other + 1) * n]


@mistake("ex21", "row_shard", "test_shard_errors")
def row_shard_accepts_a_bias(weight, rank, world_size, unit=1):
    """No check for a 2-D weight: a bias [out] gets sliced, though a row-parallel bias is added once, whole."""
    n = _shard_checked(weight.shape[-1], rank, world_size, unit)  # MISTAKE: ValueError unless weight is 2-D
    return weight[..., rank * n:(rank + 1) * n]


def _heads_checked(config, rank, world_size):
    if world_size < 1 or not 0 <= rank < world_size or config.n_heads % world_size or config.n_kv_heads % world_size:
        raise ValueError("bad split")
    return config.n_heads // world_size, config.n_kv_heads // world_size


@mistake("ex21", "heads_of_rank", "test_heads_of_each_rank")
def heads_kv_split_like_the_query_heads(config, rank, world_size):
    """K/V heads r·H/N .. (r+1)·H/N - 1: the query heads' block, as if every query head had a K/V head."""
    q, _ = _heads_checked(config, rank, world_size)
    return range(rank * q, (rank + 1) * q), range(rank * q, (rank + 1) * q)  # MISTAKE: n_kv_heads / N


@mistake("ex21", "heads_of_rank", "test_heads_of_each_rank")
def heads_kv_replicated_on_every_rank(config, rank, world_size):
    """Every rank keeps all K/V heads: N copies of the KV cache, and each rank's k_proj is not its shard."""
    q, _ = _heads_checked(config, rank, world_size)
    return range(rank * q, (rank + 1) * q), range(config.n_kv_heads)  # MISTAKE: this rank's Hkv/N heads


@mistake("ex21", "heads_of_rank", "test_heads_of_each_rank")
def heads_gqa_group_from_n_kv_heads(config, rank, world_size):
    """The K/V heads from the query heads divided by n_kv_heads, not by the group size H/Hkv."""
    q, _ = _heads_checked(config, rank, world_size)
    first, last = rank * q, (rank + 1) * q
    return range(first, last), range(first // config.n_kv_heads, last // config.n_kv_heads)  # MISTAKE: // (H/Hkv)


@mistake("ex21", "heads_of_rank", "test_heads_of_each_rank")
def heads_round_robin(config, rank, world_size):
    """Heads r, r + N, r + 2N, ...: not the contiguous blocks column_shard cuts q_proj and k_proj into."""
    _heads_checked(config, rank, world_size)
    return range(rank, config.n_heads, world_size), range(rank, config.n_kv_heads, world_size)  # MISTAKE: blocks


@mistake("ex21", "heads_of_rank", "test_heads_of_rank_errors")
def heads_check_only_the_query_heads(config, rank, world_size):
    """Checks that N divides n_heads but not n_kv_heads: 3 K/V heads 'split' over 9 ranks."""
    if world_size < 1 or not 0 <= rank < world_size or config.n_heads % world_size:  # MISTAKE: and n_kv_heads
        raise ValueError("bad split")
    q, kv = config.n_heads // world_size, config.n_kv_heads // world_size
    return range(rank * q, (rank + 1) * q), range(rank * kv, (rank + 1) * kv)


def _bytes_checked(n_tokens, world_size, dtype_bytes):
    if n_tokens < 0 or world_size < 1 or dtype_bytes < 1:
        raise ValueError("bad input")


@mistake("ex21", "all_reduce_bytes_per_layer", "test_bytes_of_a_long_prefill_over_8_ranks")
def all_reduce_bytes_forgets_the_ring_factor(config, n_tokens, world_size, dtype_bytes):
    """2 · tensor: each all-reduce sends the whole tensor once, the ring's 2(N-1)/N forgotten."""
    _bytes_checked(n_tokens, world_size, dtype_bytes)
    return float(2 * n_tokens * config.d_model * dtype_bytes) if world_size > 1 else 0.0  # MISTAKE: · 2(N-1)/N


@mistake("ex21", "all_reduce_bytes_per_layer", "test_bytes_of_a_decode_step")
def all_reduce_bytes_one_all_reduce_per_layer(config, n_tokens, world_size, dtype_bytes):
    """One all-reduce a layer: the one after the MLP, forgetting the one after attention's o_proj."""
    return _all_reduce_bytes(config, n_tokens, world_size, dtype_bytes) / 2  # MISTAKE: 2 all-reduces a layer


@mistake("ex21", "all_reduce_bytes_per_layer", "test_bytes_of_a_decode_step")
def all_reduce_bytes_in_float32(config, n_tokens, world_size, dtype_bytes):
    """The activations counted as float32 (4 bytes) whatever the model's dtype."""
    _bytes_checked(n_tokens, world_size, dtype_bytes)
    return _all_reduce_bytes(config, n_tokens, world_size, 4)  # MISTAKE: dtype_bytes


@mistake("ex21", "all_reduce_bytes_per_layer", "test_bytes_of_a_decode_step")
def all_reduce_bytes_naive_ring(config, n_tokens, world_size, dtype_bytes):
    """2(N-1) · tensor per all-reduce: whole tensors passed round the ring, not 1/N chunks of them."""
    _bytes_checked(n_tokens, world_size, dtype_bytes)
    return 2 * 2 * (world_size - 1) * n_tokens * config.d_model * dtype_bytes * 1.0  # MISTAKE: / N


@mistake("ex21", "all_reduce_bytes_per_layer", "test_bytes_of_a_decode_step")
def all_reduce_bytes_of_the_whole_ring(config, n_tokens, world_size, dtype_bytes):
    """N · 2(N-1)/N: the bytes all ranks send together, not what each rank sends."""
    return world_size * _all_reduce_bytes(config, n_tokens, world_size, dtype_bytes)  # MISTAKE: per rank


@mistake("ex21", "all_reduce_bytes_per_layer", "test_bytes_of_a_decode_step")
def all_reduce_bytes_mlp_sized_by_d_mlp(config, n_tokens, world_size, dtype_bytes):
    """The MLP's all-reduce sized [n_tokens, d_mlp]: down_proj's output is d_model wide, its input d_mlp."""
    _bytes_checked(n_tokens, world_size, dtype_bytes)
    ring = 2 * (world_size - 1) / world_size
    return ring * n_tokens * (config.d_model + config.d_mlp) * dtype_bytes  # MISTAKE: d_model twice


@mistake("ex21", "all_reduce_bytes_per_layer", "test_bytes_of_a_decode_step")
def all_reduce_bytes_times_n_layers(config, n_tokens, world_size, dtype_bytes):
    """Multiplied by n_layers: a whole pass, not one layer."""
    return config.n_layers * _all_reduce_bytes(config, n_tokens, world_size, dtype_bytes)  # MISTAKE: one layer


@mistake("ex21", "all_reduce_bytes_per_layer", "test_bytes_of_a_decode_step")
def all_reduce_bytes_one_over_n_of_the_tensor(config, n_tokens, world_size, dtype_bytes):
    """Each rank sends its 1/N share once per all-reduce: 2 · tensor / N, not 2 · 2(N-1)/N · tensor."""
    _bytes_checked(n_tokens, world_size, dtype_bytes)
    return 2 * n_tokens * config.d_model * dtype_bytes / world_size  # MISTAKE: 2(N-1)/N per all-reduce
