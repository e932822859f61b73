"""Exercise 2: scaled dot-product attention, written out.

Write ``eager_attention(q, k, v)``: softmax(q·kᵀ / √head_dim + causal mask) · v. Here every
query head has its own K/V head (n_kv_heads = n_heads); exercise 4 adds grouped-query
attention. Build the mask with ``causal_mask`` (below, minillm's; or paste your exercise 1)
and put -inf where it is False before the softmax. ``hook`` and ``name`` can be ignored;
``scale`` cannot (a model may set its own, see the docstring), nor can ``window`` (sliding-window
models, lesson 03): pass it on to ``causal_mask``. Checked in float32, bfloat16 and float16,
where a softmax must subtract the row's max (torch.softmax does) or large scores give NaN.

Check:      minillm check ex02   (or: pytest tests/exercises -m ex02 --impl student)
Lesson:     lessons/01-what-is-inference.md#attention
Reference:  minillm.model.eager_attention
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import math  # noqa: F401

import torch

from minillm.model import Hook, causal_mask  # noqa: F401


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
    B, H, T, D = q.shape
    q, k, v = q.float(), k.float(), v.float()  # softmax in float32 for stability
    Hkv, S = k.shape[1], k.shape[2]
    n_rep = H // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    qg = q.view(B, Hkv, n_rep, T, D)
    scores = (qg @ k.unsqueeze(2).transpose(-1, -2)) * scale
    mask = causal_mask(T, S, device=q.device, window=window)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ v.unsqueeze(2)
    return out.reshape(B, H, T, D)
