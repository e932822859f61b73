"""A request inside the engine: its tokens, how many have K/V in the pool, and its timeline.

The one number the scheduler works with is ``num_computed_tokens``, how many of the
request's tokens already have their K/V in the paged cache::

    prompt (7) + output (2):   t0 t1 t2 t3 t4 t5 t6 | o0 o1
    num_computed_tokens 8:     ====================== ==      o1 is next: a decode of 1 token
    chunked prefill, 4 done:   ==========                      3 prompt tokens left to prefill

A step schedules ``num_tokens - num_computed_tokens`` tokens (or fewer, a chunk). When the
computed tokens reach the end, the last position's logits give a new token. Preemption
sets ``num_computed_tokens`` back to 0: the K/V is recomputed from prompt + output later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Request:
    """One request's state and timestamps (seconds from ``time.perf_counter()``).

    Attributes:
        request_id: the engine's name for it (a string, as in vLLM).
        prompt_ids: the prompt's token ids.
        params: its :class:`~minillm.sampling.SamplingParams` (its own seed, stop ids, max tokens).
        arrival_s: when it reached the engine.
        output_ids: tokens generated so far.
        status: "waiting", "running" or "finished".
        num_computed_tokens: tokens whose K/V is in the paged cache.
        num_cached_tokens: prompt tokens that were prefix-cache hits when first scheduled.
        finish_reason: None while running; "eos", "stop", "length", "abort" or "error" (a part of
            this request failed during a step; it alone ended).
        stop_reason: the stop id or stop string that ended it; for "error", the part that failed
            (see :attr:`~minillm.serving.engine.RequestOutput.stop_reason`); else None.
        message: why an "abort", "length" or "error" ended it early (a full pool, a failed
            constraint), else None.
        first_scheduled_s, finish_s: when it first got a slot in a batch, when it finished.
        token_times_s: when each output token was known.
        num_preemptions, preempted_s: how often it lost its blocks, and when.
        generator: its seeded random generator (None: the global one), kept across steps.
        num_logprobs: None, or how many top tokens to keep with each output token's logprob.
        output_logprobs: with num_logprobs, one (logprob, [(id, logprob), ...]) per output token.
        num_prompt_logprobs: None, or how many top tokens to keep with each prompt token's logprob.
        prompt_logprobs: with num_prompt_logprobs, one (logprob, [(id, logprob), ...]) per prompt
            token after the first (token j's from the logits at position j - 1), filled chunk by
            chunk as the prefill runs.
        index: which of the request's n sequences this is (parallel sampling; 0 when n = 1).
        parent_id: for the sequences 1..n-1, the id ``add_request`` returned (sequence 0 is the
            request itself), else None; RequestOutputs carry that id and ``index``.
        num_forks: sequences still to fork from this one when its prefill completes (n - 1, then 0).
        cache_salt: the tenant's salt (vLLM's ``cache_salt``): its block chain starts from
            ``block_hash.salted_seed(seed, cache_salt)``, so it shares blocks only with requests of the
            same salt, in every tier; None: no salt.
        cache_points: the :class:`~minillm.serving.kv_tiers.CachePoint` s (prefixes to pin in the tiers, each
            for its own ttl), shortest first; () without any.
        matcher: with ``params.allowed_tokens`` (constrained decoding), this sequence's
            :class:`~minillm.sampling.TokenMatcher`: asked for the allowed tokens before each token,
            told each token appended. It lives with the output tokens, so a preemption (which keeps
            them and recomputes only K/V) leaves it right; else None.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float
    output_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    message: str | None = None
    first_scheduled_s: float | None = None
    finish_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    preempted_s: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    text_stream: object = None  # a minillm.stopping.TextStream when the engine has a tokenizer
    num_logprobs: int | None = None
    output_logprobs: list = field(default_factory=list)
    num_prompt_logprobs: int | None = None
    prompt_logprobs: list = field(default_factory=list)
    index: int = 0
    parent_id: str | None = None
    num_forks: int = 0
    matcher: object = None
    cache_salt: str | None = None
    cache_points: tuple = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: what the cache must hold before the next token."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prompt_logits_from(self) -> int | None:
        """The first position whose logits the prompt's logprobs still need (their positions run
        up to the prompt's second last), or None when none are needed (not asked, or all kept).
        The scheduler takes prefix-cache hits only below it: a cached block's K/V is there, but
        not the logits its positions would give."""
        if self.num_prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens - 1:
            return None
        return len(self.prompt_logprobs)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_ids)}, computed={self.num_computed_tokens}, "
                f"cached={self.num_cached_tokens}" + (f", finish_reason={self.finish_reason!r}" if self.finished else "")
                + ")")


def sequence_id(request_id: str, index: int) -> str:
    """The engine's id of sequence ``index`` of a request with n > 1: the request's own id for 0,
    ``"<id>#<index>"`` for the others (their block tables are filed under it)."""
    return request_id if index == 0 else f"{request_id}#{index}"
