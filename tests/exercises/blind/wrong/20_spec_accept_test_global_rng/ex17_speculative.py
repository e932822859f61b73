"""Exercise 17: the speculative-decoding verification rule (accept, resample, bonus).

A draft proposed k tokens d_1..d_k, drawn from its distributions q_1..q_k (a deterministic
draft such as prompt lookup: q is one-hot on each draft, passed as None). The model scored
them all in one pass: p_0..p_k, its next-token distributions at the last token and after each
draft. Write ``residual_distribution`` (normalize(max(0, p - q))) and ``accept_or_resample``:
go through the drafts in order, keep d_i with probability min(1, p_i(d_i) / q_i(d_i)) (draw
u uniform in [0, 1) with ``torch.rand((), generator=generator, device=p.device)`` and keep when u < the
ratio; a generator draws on its own device),
stop at the first rejection and draw its replacement from the residual; when every draft is
kept, draw one bonus token from p_k. The tokens that come out are then distributed exactly as
the model's own (Leviathan et al. 2023, Theorem 1). Draw tokens with
``torch.multinomial(probs, 1, generator=generator).item()``.

The checks pass small hand-made p and q (vocabularies of 3 to 5 tokens) and count what comes
out over a few thousand draws.

Check:      minillm check ex17   (or: pytest tests/exercises -m ex17 --impl student)
Lesson:     lessons/09-optimisations.md#speculative-decoding-one-step-at-a-time
Reference:  minillm.speculative.residual_distribution, accept_or_resample
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import torch


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected draft's replacement is drawn from: normalize(max(0, p - q)).

    p, q: [vocab] the target's and the draft's distributions at one position. Returns [vocab]
    float, summing to 1: the mass p has beyond q. Rejecting d with probability 1 - min(1, p(d)/q(d))
    takes away exactly q's excess, so drawing the replacement from here gives back p (Leviathan
    et al. 2023, Theorem 1; Chen et al. 2023). When p == q (up to rounding) nothing is left
    and a rejection had probability ~0: p itself is returned.
    """
    r = (p - q).clamp(min=0)
    s = r.sum()
    if s <= 1e-6:
        return p
    return r / s


def accept_or_resample(p: torch.Tensor, q: torch.Tensor | None, draft_ids: list[int], generator=None):
    """The verification rule: which drafts to keep, and the one token the target adds.

    Args:
        p: [k+1, vocab] the target's distributions at the last token and after each draft.
        q: [k, vocab] the draft's distributions (None: one-hot on each draft, a deterministic draft).
        draft_ids: the k proposed tokens.
        generator: random source for the accept test and the draws.

    Returns (n_accepted, token): drafts[:n_accepted] are kept, then ``token``: drawn from
    normalize(max(0, p_i - q_i)) at the first rejection i, else the bonus token from p_k.
    Accepting d with probability min(1, p(d)/q(d)) and resampling from the residual gives
    tokens distributed exactly as p (Leviathan et al. 2023, Theorem 1).
    """
    k = len(draft_ids)
    for i, d in enumerate(draft_ids):
        d = int(d)
        if q is None:
            qi = torch.zeros_like(p[i])
            qi[d] = 1.0
        else:
            qi = q[i]
        pd, qd = float(p[i, d]), float(qi[d])
        ratio = min(1.0, pd / qd) if qd > 0 else 1.0
        u = torch.rand((), device=p.device)
        if u < ratio:
            continue
        resid = residual_distribution(p[i], qi)
        token = torch.multinomial(resid, 1, generator=generator).item()
        return i, token
    token = torch.multinomial(p[k], 1, generator=generator).item()
    return k, token
