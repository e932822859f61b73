"""Exercise 8: sampling: greedy, temperature, top-k, top-p.

Write ``filter_logits(logits, params)`` (temperature, then top-k, then top-p) and
``sample(logits, params, generator)`` (greedy at temperature 0, else a draw from the
filtered distribution). ``params`` is a minillm SamplingParams: ``temperature``,
``top_k`` (0 = off), ``top_p`` (1 = off), and ``params.greedy`` (temperature == 0).

Check:      minillm check ex08   (or: pytest tests/exercises -m ex08 --impl student)
Lesson:     lessons/07-sampling.md
Reference:  minillm.sampling.filter_logits, minillm.sampling.sample
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import torch

from minillm.sampling import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits [B, vocab] (float32).

    Removed tokens get -inf. The token that first crosses the top_p threshold is kept,
    and the most likely token is always kept.
    """
    raise NotImplementedError(
        "Exercise 8 (sampling) is not written yet: see lessons/07-sampling.md#top-p"
    )


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None):
    """Pick the next token of each sequence.

    Args:
        logits: [B, vocab] float32 next-token logits.
        params: the sampling settings.
        generator: random source (see :meth:`SamplingParams.make_generator`).

    Returns (token_ids [B] int64, logprobs [B] float32). The logprob is that of the
    chosen token under the model's own distribution (log_softmax of the raw logits,
    before temperature and filtering), as OpenAI-style APIs report it.
    """
    raise NotImplementedError(
        "Exercise 8 (sampling) is not written yet: see lessons/07-sampling.md#greedy"
    )
