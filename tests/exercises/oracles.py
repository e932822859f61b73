"""Independent oracles: the textbook formula, written the slow and obvious way."""

from __future__ import annotations

import math

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention one query at a time: softmax(q·kᵀ · scale) · v over the keys it may see.

    scale defaults to 1/√head_dim (Vaswani et al. 2017).

    q: [B, n_heads, T, head_dim]; k, v: [B, n_kv_heads, S, head_dim]. Query i sits at
    position S - T + i and sees keys 0..S - T + i. Query head h reads K/V head h // n_rep.
    """
    B, H, T, D = q.shape
    n_rep = H // k.shape[1]
    S = k.shape[2]
    out = torch.zeros_like(q)
    for h in range(H):
        kv = h // n_rep
        for i in range(T):
            seen = S - T + i + 1
            scale_ = 1 / math.sqrt(D) if scale is None else scale
            scores = q[:, h, i : i + 1] @ k[:, kv, :seen].transpose(-1, -2) * scale_  # [B, 1, seen]
            out[:, h, i : i + 1] = torch.softmax(scores, dim=-1) @ v[:, kv, :seen]
    return out


def filter_row(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """One row of logits through temperature, then top-k, then top-p, with Python floats (vLLM's order).

    Divide by the temperature; keep the top_k largest (0: all); walk the survivors from the most
    likely down, keeping each while the probability mass before it is < top_p. Dropped: -inf.
    """
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k else order
    z = sum(math.exp(scaled[i]) for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += math.exp(scaled[i]) / z
    return [scaled[i] if i in nucleus else -math.inf for i in range(len(scaled))]


def speculative_outcomes(p: list[list[float]], q: list[list[float]] | None, draft_ids: list[int]) -> dict:
    """The exact probability of each result (n_accepted, token) of the verification rule, with floats.

    Draft i is kept with probability a_i = min(1, p_i(d_i) / q_i(d_i)) (q one-hot when None: a_i =
    p_i(d_i)), in order; the first rejection i (probability kept-so-far · (1 - a_i)) draws its token
    from max(0, p_i - q_i) / its sum; all kept: the bonus token from p_k (Leviathan et al. 2023).
    """
    outcomes, reach = {}, 1.0  # reach: the probability of getting to draft i
    for i, d in enumerate(draft_ids):
        q_i = q[i] if q is not None else [1.0 if t == d else 0.0 for t in range(len(p[i]))]
        keep = min(1.0, p[i][d] / q_i[d])
        residual = [max(0.0, a - b) for a, b in zip(p[i], q_i)]
        total = sum(residual)
        for t, r in enumerate(residual):
            if r > 0:
                outcomes[(i, t)] = reach * (1 - keep) * r / total
        reach *= keep
    for t, prob in enumerate(p[len(draft_ids)]):
        if prob > 0:
            outcomes[(len(draft_ids), t)] = outcomes.get((len(draft_ids), t), 0.0) + reach * prob
    return outcomes
