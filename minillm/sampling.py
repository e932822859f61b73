"""Turning logits into the next token: greedy, temperature, top-k and top-p.

Order of operations (as in Hugging Face ``generate`` and vLLM):

    logits / temperature -> keep the top_k largest -> keep the smallest set whose
    probabilities sum to >= top_p -> softmax -> draw one token

temperature 0 means greedy: take the argmax, no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        temperature: >= 0. 0 is greedy (argmax); 1 samples the model's distribution;
            higher flattens it, lower sharpens it.
        top_k: >= 0. Keep only the k most likely tokens; 0 disables.
        top_p: in (0, 1]. Nucleus sampling (Holtzman et al. 2019): keep the smallest set of
            most likely tokens whose probabilities sum to at least top_p; 1 disables.
        seed: seed of the random generator; the same seed gives the same output.
        max_new_tokens: >= 1, the most tokens to generate.
        stop_token_ids: extra ids that end generation (besides the model's EOS).

    Raises ValueError naming the parameter and its allowed range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self, device) -> torch.Generator | None:
        """A seeded torch.Generator for ``device``, or None (global RNG) when no seed is set."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits [B, vocab] (float32).

    Removed tokens get -inf. The token that first crosses the top_p threshold is kept,
    and the most likely token is always kept.
    """
    logits = logits / params.temperature
    if params.top_k:
        kth_largest = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Mass strictly before each token: a token is dropped once the tokens ahead
        # of it already reach top_p, so the one that crosses the threshold stays.
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


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
    if params.greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        probs = torch.softmax(filter_logits(logits, params), dim=-1)
        token_ids = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)
    return token_ids, logprobs
