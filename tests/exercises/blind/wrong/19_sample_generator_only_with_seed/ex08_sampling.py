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
    x = logits.to(torch.float32)
    t = params.temperature
    if not params.greedy and t != 1.0:
        x = x / t
    if params.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        top = probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(probs < params.min_p * top, float("-inf"))
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        remove = before >= params.top_p
        remove[..., 0] = False
        sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return x


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
    x = logits.to(torch.float32)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if torch.isnan(x).any() or torch.isposinf(x).any():
        raise ValueError("logits hold NaN or +inf")
    if not torch.isfinite(x).any(dim=-1).all():
        raise ValueError("a row of logits has no finite value")
    logprobs_all = torch.log_softmax(x, dim=-1)
    if params.greedy:
        ids = torch.argmax(x, dim=-1)
    else:
        shifted = x - x.max(dim=-1, keepdim=True).values
        filtered = filter_logits(shifted, params)
        probs = torch.softmax(filtered, dim=-1)
        ids = torch.multinomial(probs, 1, generator=generator if params.seed is not None else None).squeeze(-1)
    ids = ids.to(torch.int64)
    lp = logprobs_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1).to(torch.float32)
    return ids, lp
