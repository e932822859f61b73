"""Exercise 6: prefill, the whole prompt in one forward pass.

Write ``prefill(model, token_ids, cache)`` from the model's parts, without calling
``model(...)`` itself: model.embed (token embedding), model.pos_embed (GPT-2's learned positions; None for
Llama), model.rope (Llama's RotaryEmbedding; None for GPT-2), model.blocks (each
``block(x, rope_cos_sin, cache, model.attn_impl, hook)`` writes its K/V into the cache and
attends over everything cached), ``cache.advance(T)``, model.ln_final and model.lm_head.
The positions start at ``cache.length`` (a prompt can be prefilled after a cached prefix).
The checks pass token_ids as a [B, T] int64 tensor and leave hook and trace unset. They also
grade the errors the docstring promises: check the ids and ``cache.check_room(T)`` first.

Check:      minillm check ex06   (or: pytest tests/exercises -m ex06 --impl student)
Lesson:     lessons/02-prefill-and-decode.md#prefill
Reference:  minillm.phases.prefill; Transformer.forward in minillm/model.py
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import torch

from minillm.kv_cache import KVCache
from minillm.model import Hook, Transformer  # noqa: F401


def prefill(model: Transformer, token_ids, cache: KVCache, hook: Hook | None = None, trace=None) -> torch.Tensor:
    """Process a prompt in one forward pass, filling the KV cache.

    Args:
        model: the transformer.
        token_ids: [T] or [B, T] int64 (a list of ints is accepted). Positions start at
            ``cache.length``, so a suffix can be prefilled onto an already filled cache
            (this is how the prefix cache skips a cached prefix).
        cache: the KV cache; its length grows by T.
        hook: optional ``hook(name, tensor)`` observer of per-layer activations.
        trace: optional :class:`~minillm.trace.Trace`; records a "prefill" event (time,
            FLOPs, bytes, K/V written). None: nothing is timed.

    Returns float32 logits of the last position, [B, vocab].

    Raises ValueError (empty prompt, wrong rank or batch, ids out of vocab range, a cache
    or trace that does not fit), CacheFullError (the prompt does not fit in the cache).
    """
    ids = token_ids

    device = model.embed.weight.device
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"token ids must be integers, got {ids.dtype}")
    ids = ids.to(device=device, dtype=torch.long)

    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2:
        raise ValueError(f"token_ids must be [T] or [B, T], got shape {list(ids.shape)}")
    B, T = ids.shape
    if T == 0:
        raise ValueError("empty prompt")
    if B != cache.batch_size:
        raise ValueError(f"batch {B} does not match the cache's batch {cache.batch_size}")
    V = model.config.vocab_size
    if ids.min() < 0 or ids.max() >= V:
        raise ValueError(f"token ids out of range [0, {V})")
    cache.check_room(T)
    pos = torch.arange(cache.length, cache.length + T, device=device)
    x = model.embed(ids)
    if model.pos_embed is not None:
        x = x + model.pos_embed(pos)
    cos_sin = model.rope(pos, x.dtype) if model.rope is not None else None
    for block in model.blocks:
        x = block(x, cos_sin, cache, model.attn_impl, hook)
    cache.advance(T)
    x = model.ln_final(x[:, -1:, :])
    return model.lm_head(x)[:, -1, :]
