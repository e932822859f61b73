"""Correct solutions written differently from the reference: the checks must pass them all.

A check that demands the reference's exact way of working (its order of operations, its
internal calls, its RNG draws beyond what the docstring fixes) would fail a right answer.
Each function here replaces one name of its exercise (see ``registry.py``) as a student
might write it: loops instead of one torch call, another formula with the same result.
``test_alternatives_pass.py`` runs every check of the exercise on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Alternative:
    """A correct ``fn`` standing in for ``replaces`` of ``exercise``, written another way."""

    exercise: str
    replaces: str
    fn: Callable

    @property
    def name(self) -> str:
        return self.fn.__name__


ALTERNATIVES: list[Alternative] = []


def alternative(exercise: str, replaces: str):
    def register(fn):
        ALTERNATIVES.append(Alternative(exercise, replaces, fn))
        return fn

    return register


# -- ex01 ------------------------------------------------------------------------------------------


@alternative("ex01", "causal_mask")
def mask_from_positions(n_queries, n_keys, device=None, window=None):
    """Compare each query's position with each key's, as the docstring states the rule."""
    query_pos = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]
    key_pos = torch.arange(n_keys, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask
