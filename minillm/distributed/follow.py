"""Rank 0 decides, the other ranks follow: every request is sent to every rank before it runs.

    rank 0 (reads the prompt, prints)          ranks 1..N-1 (quiet)
    lead(group, "generate", ids, params, eos)  -> follow(): receive, run the same generate()
    generate(...)  ───── all-reduce ─────────     generate(...)       each pass: the same tokens,
                   ───── all-gather ─────────                         the same full logits
    lead(group, None)                          -> follow() returns

    (serving: lead_engine(engine) sends "engine", then every step's batch: minillm/distributed/engine.py)

Each rank runs the same loop over the same logits (the all-gather hands every rank the whole row),
so each picks the same token: greedy trivially, sampling because rank 0 fixes the seed it sends
(a fresh one when the user gave none). No token needs to travel back.
"""

from __future__ import annotations

import dataclasses
import random

from ..generate import generate
from ..sweep import warm_up
from .comm import TensorParallelGroup
from .engine import follow_engine


def lead(group: TensorParallelGroup, kind: str | None, *payload):
    """On rank 0: tell the followers what to run next ("warmup" n_tokens, "generate" prompt_ids params
    eos_token_ids; None: stop). Returns ``payload`` with a "generate" request's seed fixed, which rank 0
    must then use itself. Raises TensorParallelError when a follower is gone."""
    if kind == "generate":
        prompt_ids, params, eos = payload
        if not params.greedy and params.seed is None:  # every rank must draw the same numbers
            params = dataclasses.replace(params, seed=random.randrange(2**63))
        payload = (list(prompt_ids), params, sorted(eos))
    group.broadcast_object((kind, payload))
    return payload


def follow(model, group: TensorParallelGroup, tokenizer=None) -> None:
    """On ranks 1..N-1: run what rank 0 sends (a generate() request, a warm-up, an engine's steps) until
    it says stop. ``tokenizer``: the one rank 0's generate() gets (stop strings are matched on text).
    Raises TensorParallelError when rank 0 is gone."""
    kind, payload = group.broadcast_object()
    while kind is not None:
        if kind == "engine":  # rank 0 serves: its steps' batches follow until it sends something else
            kind, payload = follow_engine(model, *payload, receive=group.broadcast_object)
            continue
        if kind == "warmup":
            warm_up(model, *payload)
        elif kind == "generate":
            prompt_ids, params, eos = payload
            for _ in generate(model, prompt_ids, params, eos_token_ids=set(eos), tokenizer=tokenizer):
                pass
        else:
            raise ValueError(f"rank {group.rank}: unknown request kind {kind!r} from rank 0")
        kind, payload = group.broadcast_object()
