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
    raise NotImplementedError(
        "Exercise 6 (prefill) is not written yet: see lessons/02-prefill-and-decode.md#prefill"
    )
