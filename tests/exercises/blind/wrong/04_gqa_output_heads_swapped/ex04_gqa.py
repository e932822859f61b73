"""Exercise 4: grouped-query attention (GQA).

Write ``eager_attention(q, k, v)`` again (start from your exercise 2), now with fewer K/V
heads than query heads: each K/V head serves n_rep = n_heads // n_kv_heads consecutive
query heads. This is what shrinks the KV cache of Llama-3 and Mistral by n_rep.
Don't copy K and V n_rep times: view q as [B, n_kv_heads, n_rep, T, head_dim] and let
k, v broadcast over n_rep.

Check:      minillm check ex04   (or: pytest tests/exercises -m ex04 --impl student)
Lesson:     lessons/03-kv-cache.md#grouped-query-attention
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
    return out.transpose(1, 2).reshape(B, H, T, D)
