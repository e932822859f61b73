"""Exercise 1: the causal mask.

Write ``causal_mask(n_queries, n_keys)``: which keys each query may attend to, True where
allowed. A prompt from an empty cache gives a square mask. New queries after cached keys
(a decode step, or a prompt suffix prefilled after a prefix-cache hit) give a rectangle:
the queries are the *last* n_queries positions. One torch call is enough (see the
``diagonal`` argument of ``torch.tril``). The ``window`` argument (sliding-window models such
as Mistral, lesson 03) is a second step, checked too: ``torch.triu`` cuts the band.

Check:      minillm check ex01   (or: pytest tests/exercises -m ex01 --impl student)
Lesson:     lessons/02-prefill-and-decode.md#the-causal-mask
Reference:  minillm.model.causal_mask
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import torch


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
    offset = n_keys - n_queries
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    mask = torch.tril(ones, diagonal=offset)
    if window is not None:
        mask = mask & torch.triu(ones, diagonal=offset - window + 1)
    return mask
