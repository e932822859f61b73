"""Exercise 8: sampling: greedy, temperature, top-k, top-p.

Write ``filter_logits(logits, params)`` (temperature, then top-k, then top-p) and
``sample(logits, params, generator)`` (greedy at temperature 0, else a draw from the
filtered distribution). ``params`` is a minillm SamplingParams: ``temperature``,
``top_k`` (0 = off), ``top_p`` (1 = off), and ``params.greedy`` (temperature == 0).
min-p and the penalties (``params.min_p``, ``prompt_ids``, ``output_ids``) are beyond this
exercise: the checks leave them off, so your code may ignore them.

Check:      minillm check ex08   (or: pytest tests/exercises -m ex08 --impl student)
Lesson:     lessons/07-sampling.md
Reference:  minillm.sampling.filter_logits, minillm.sampling.sample
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import torch

from minillm.sampling import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, min-p, top-k and top-p to logits [B, vocab] (float32), in that order.

    Removed tokens get -inf. The token that first crosses the top_p threshold is kept,
    and the most likely token is always kept. Tied logits at the k-th place are all kept
    (as in vLLM and transformers). :func:`sample` shifts the logits so that the largest is 0
    first, which keeps a small temperature from overflowing to +inf.
    """
    raise NotImplementedError(
        "Exercise 8 (sampling) is not written yet: see lessons/07-sampling.md#top-p"
    )


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           prompt_ids=None, output_ids=None):
    """Pick the next token of each sequence.

    Args:
        logits: [B, vocab] next-token logits (any float dtype; computed in float32).
            Each row needs a finite value; -inf entries are tokens that cannot be picked.
        params: the sampling settings.
        generator: random source (see :meth:`SamplingParams.make_generator`).
        prompt_ids, output_ids: [B, T] int64 (or lists) of the prompt and the tokens generated
            so far; needed only when ``params`` sets a penalty (None = no tokens).

    Returns (token_ids [B] int64, logprobs [B] float32). The logprob is that of the
    chosen token under the model's own distribution (log_softmax of the raw logits,
    before penalties, temperature and filtering), as OpenAI-style APIs and vLLM report it.

    Raises ValueError when a row of logits has no finite value, or holds NaN or +inf.
    """
    raise NotImplementedError(
        "Exercise 8 (sampling) is not written yet: see lessons/07-sampling.md#greedy"
    )
