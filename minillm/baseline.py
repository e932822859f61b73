"""The no-KV-cache baseline: the textbook sampler that re-reads the whole sequence per token.

This is how nanoGPT's ``generate`` works (karpathy/nanoGPT, ``model.py``): to get token
n+1 it runs the model over all n tokens so far, keeps the last position's logits and
throws every other position's K and V away. Token n costs a forward pass over n
positions, so a reply of N tokens after a prompt of P costs about N·P + N²/2 token-passes
instead of P + N with a KV cache (:mod:`minillm.phases`).

    step 1: [t0 t1 t2 t3]          -> t4      4 positions computed
    step 2: [t0 t1 t2 t3 t4]       -> t5      5 positions (4 of them again)
    step 3: [t0 t1 t2 t3 t4 t5]    -> t6      6 positions (5 of them again)

It uses the same :class:`~minillm.model.Transformer` (called without a cache), so its
greedy tokens equal minillm's: only the speed differs. The benchmark
(:mod:`minillm.bench`) measures it next to the cached engines.
"""

from __future__ import annotations

from typing import Callable

import torch

from .model import Transformer


@torch.inference_mode()
def generate_no_cache(
    model: Transformer,
    idx: torch.Tensor,
    max_new_tokens: int,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Greedy generation without a KV cache, nanoGPT style.

    Args:
        model: the transformer.
        idx: the prompt, [B, T] int64.
        max_new_tokens: how many tokens to append (>= 1).
        on_token: called with each new token [B] as soon as it is known (the
            benchmark's clock).

    Returns [B, T + max_new_tokens]: the prompt followed by the generated tokens.
    Raises ValueError when the sequence would outgrow the model's context
    (nanoGPT crops the context instead; a crop would change the tokens).
    """
    if idx.shape[1] + max_new_tokens - 1 > model.config.max_seq_len:
        raise ValueError(f"{idx.shape[1]} + {max_new_tokens} tokens exceed the context of {model.config.max_seq_len}")
    for _ in range(max_new_tokens):
        logits = model(idx, last_only=True)  # every position recomputed; LM head on the last only
        idx_next = logits[:, -1].argmax(dim=-1)  # [B]
        idx = torch.cat((idx, idx_next[:, None]), dim=1)
        if on_token is not None:
            on_token(idx_next)
    return idx
