"""Exercise 7: one decode step.

Write ``decode_step(model, token_id, cache)`` from the model's parts, without calling
``model(...)`` itself: model.embed (token embedding), model.pos_embed (GPT-2's learned positions; None for
Llama), model.rope (Llama's RotaryEmbedding; None for GPT-2), model.blocks (each
``block(x, rope_cos_sin, cache, model.attn_impl, hook)`` writes its K/V into the cache and
attends over everything cached), ``cache.advance(T)``, model.ln_final and model.lm_head.
The one new token of each sequence sits at position ``cache.length``. The checks pass
token_id as a [B] int64 tensor and leave hook and trace unset. They also grade the errors
the docstring promises: check the ids and ``cache.check_room(1)`` before the forward pass.

Check:      minillm check ex07   (or: pytest tests/exercises -m ex07 --impl student)
Lesson:     lessons/02-prefill-and-decode.md#decode
Reference:  minillm.phases.decode_step; Transformer.forward in minillm/model.py
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import torch

from minillm.kv_cache import KVCache
from minillm.model import Hook, Transformer  # noqa: F401


def decode_step(model: Transformer, token_id, cache: KVCache, hook: Hook | None = None, trace=None) -> torch.Tensor:
    """Generate the next logits from one new token per sequence.

    Args:
        token_id: the token just produced, a scalar / int (batch 1) or [B] int64.
        cache: the KV cache holding everything before it; this token's K/V is
            appended at position ``cache.length`` (length grows by 1).
        hook: optional ``hook(name, tensor)`` observer of per-layer activations.
        trace: optional :class:`~minillm.trace.Trace`; records a "decode" event.

    Returns float32 logits for the following position, [B, vocab].

    The speed layer may give the model its own step (``model.compiled_decode``: the "compile" paths'
    graph, the "replay" path's C calls, :mod:`minillm.fast.choose`): a step without hook, or with a
    trace at level "steps", then runs it instead, where it says it applies: the same logits.

    Raises ValueError (bad shape or id, several tokens for one sequence, a cache or trace
    that does not fit), CacheFullError (no room for one more token).
    """
    raise NotImplementedError(
        "Exercise 7 (decode step) is not written yet: see lessons/02-prefill-and-decode.md#decode"
    )
