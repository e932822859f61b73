"""Speculative decoding: a cheap draft guesses k tokens, the model checks them in one pass.

Decode reads every weight to produce one token. Checking k guessed tokens costs about the
same single read (a short prefill onto the filled KV cache), so each accepted guess is a
token for free. Exact verification (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
Sampling") keeps the output distribution exactly the model's:

    draft:    last=t4   propose  d1 d2 d3                      (k = 3; q_i: the draft's distributions)
    verify:   [t4 d1 d2 d3] --one pass onto the cache--> p_0 p_1 p_2 p_3   (the target's, k+1 rows: phases.verify)
    accept:   d_i with probability min(1, p_i(d_i) / q_i(d_i)), in order, until one is rejected
    resample: at the first rejection, draw from normalize(max(0, p_i - q_i)): that replaces d_i
    bonus:    all k accepted: one more token drawn from p_k, for free
    truncate: the cache keeps t4 and the accepted drafts; rejected positions go (KVCache.truncate)

Greedy decoding is the case where p and q are one-hot: accept while d_i is the model's
argmax, then take the argmax. So the greedy output is token for token plain greedy's.

Drafts implement :class:`Draft` (``propose(token_ids, k) -> list[int]``): here prompt lookup
(:class:`NgramDraft`, no second model) and a small model with the same vocabulary
(:class:`DraftModel`); write a third and pass it as method "custom". Names follow vLLM's
``speculative_config``.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .model import Transformer
from .phases import decode_step, prefill, verify
from .sampling import SamplingParams, apply_penalties, as_token_ids, filter_logits, sample
from .stopping import GenerationStep, TextStream, check_stop

METHODS = ("ngram", "draft_model", "custom")
SCHEDULES = ("heuristic", "constant")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate; the names are vLLM's ``speculative_config`` keys.

    Attributes:
        method: "ngram" (prompt lookup: propose what followed the last n-gram earlier in the
            prompt + output) or "draft_model" (a small model with the same vocabulary).
        num_speculative_tokens: k >= 1, the most tokens the draft proposes per verification pass.
        num_speculative_tokens_schedule: "heuristic" (default): k starts at num_speculative_tokens,
            grows by 2 after a pass that accepted every draft and shrinks by 1 (to 1 at least) after
            one that rejected some, so rejected guesses cost fewer wasted rows; "constant": always
            num_speculative_tokens. (transformers' ``num_assistant_tokens_schedule``; minillm's name.)
        prompt_lookup_min, prompt_lookup_max: n-gram sizes tried, longest first (ngram only).
            Default 2..3: a one-token match proposes mostly wrong guesses in free text (on
            SmolLM2, 1..3 kept 10-20 % of the drafts of a story, 2..3 35 %; BENCHMARKS-HISTORY.md).
        draft_model: the draft :class:`~minillm.model.Transformer` (draft_model only).
        draft: method "custom" (minillm's, not vLLM's): your own :class:`Draft` instance, used as is.

    Raises ValueError naming the field and the fix.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    num_speculative_tokens_schedule: str = "heuristic"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 3
    draft_model: Transformer | None = None
    draft: Draft | None = None

    def next_k(self, k: int, proposed: int, accepted: int) -> int:
        """The k of the next pass after one that checked ``proposed`` drafts and kept ``accepted``.

        "heuristic" (transformers' assisted generation): every draft kept -> k + 2 (the draft is
        on a run: guess further); some rejected -> k - 1 (each rejected row cost a verify row for
        nothing). A pass with no proposal (no n-gram matched) leaves k as it was.
        """
        if self.num_speculative_tokens_schedule == "constant" or proposed == 0:
            return k
        if accepted == proposed:
            return min(k + 2, self.num_speculative_tokens)
        return max(k - 1, 1)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens_schedule not in SCHEDULES:
            raise ValueError(f"num_speculative_tokens_schedule must be one of {', '.join(SCHEDULES)}, "
                             f"got {self.num_speculative_tokens_schedule!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError("method='draft_model' needs draft_model=<a loaded Transformer>, and only it takes one; "
                             f"got method={self.method!r} with draft_model={type(self.draft_model).__name__}")
        if (self.method == "custom") != (self.draft is not None) or not isinstance(self.draft, (Draft, type(None))):
            raise ValueError("method='custom' needs draft=<an instance of a Draft subclass>, and only it takes one; "
                             f"got method={self.method!r} with draft={type(self.draft).__name__}")
        if self.draft_model is not None and not isinstance(self.draft_model, Transformer):
            raise ValueError(f"draft_model must be a minillm Transformer (load_model(...)), "
                             f"got {type(self.draft_model).__name__}")


class Draft:
    """What a draft does: guess the next tokens. Subclass it and write :meth:`propose`.

    A deterministic draft (prompt lookup) only proposes: its q is one-hot, so token d is
    accepted with probability p(d). A draft that samples also returns its distributions
    from :meth:`draft_probs`, so the verifier can use min(1, p/q) and max(0, p - q).
    Run yours with ``generate(..., speculative=SpeculativeConfig("custom", k, draft=YourDraft()))``;
    whatever it proposes, the output keeps the model's distribution (only the speed changes).
    """

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` token ids guessed to follow ``token_ids`` (prompt + output so far); [] for no guess."""
        raise NotImplementedError

    def draft_probs(self) -> torch.Tensor | None:
        """q of the last proposal, [n_proposed, vocab] float32, row i the distribution d_i was drawn
        from; None (default): the draft is deterministic, q is one-hot on each proposed token."""
        return None


class NgramDraft(Draft):
    """Prompt lookup: find the last n tokens earlier in prompt + output, propose what followed.

    n goes from ``prompt_lookup_max`` down to ``prompt_lookup_min``; the latest earlier
    occurrence wins (the text most like the current one). vLLM's ngram speculator and
    transformers' ``prompt_lookup_num_tokens`` do the same search (transformers takes the
    earliest occurrence). It wins when the output copies the input: quoting, editing, code.
    """

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3):
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for n in range(min(self.prompt_lookup_max, len(token_ids) - 1), self.prompt_lookup_min - 1, -1):
            pattern = token_ids[-n:]
            for start in range(len(token_ids) - n - 1, -1, -1):  # latest first; not the pattern itself
                if token_ids[start : start + n] == pattern:
                    return token_ids[start + n : start + n + k]
        return []


class DraftModel(Draft):
    """A small model with the target's vocabulary drafts by sampling, with its own KV cache.

    Its cache holds the tokens it has seen; each :meth:`propose` keeps the part that still
    agrees with ``token_ids`` (dropping rejected drafts: ``KVCache.truncate``), prefills the
    rest, then decodes k tokens. It samples with the request's temperature, top-k and top-p
    (the same transform as the target's p; penalties are left out, which changes only how
    often drafts are accepted, never the output distribution).
    """

    def __init__(self, model: Transformer, params: SamplingParams, generator, max_seq_len: int):
        context = model.config.max_seq_len
        if max_seq_len > context:
            raise ValueError(f"the draft model's context is {context} tokens but the request may need {max_seq_len}; "
                             "use a draft with a longer context or lower max_new_tokens")
        self.model, self.params, self.generator = model, params, generator
        self.cache = KVCache.for_model(model, max_seq_len=max_seq_len)
        self.cached_ids: list[int] = []  # the tokens whose K/V self.cache holds
        self.q: torch.Tensor | None = None

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        keep = _common_prefix(self.cached_ids, token_ids[:-1])  # at least one new token to run
        self.cache.truncate(keep)
        logits = prefill(self.model, token_ids[keep:], self.cache)
        drafted, q = [], []
        for i in range(k):
            probs = token_probs(logits, self.params)[0]
            drafted.append(torch.multinomial(probs, 1, generator=self.generator).item())
            q.append(probs)
            if i < k - 1:
                logits = decode_step(self.model, drafted[-1], self.cache)
        self.cached_ids = token_ids + drafted[:-1]
        self.q = torch.stack(q)
        return drafted

    def draft_probs(self) -> torch.Tensor | None:
        return self.q


def make_draft(config: SpeculativeConfig, model: Transformer, params: SamplingParams, generator,
               max_seq_len: int) -> Draft:
    """The :class:`Draft` ``config`` names, for a request on ``model`` with a cache of ``max_seq_len``.
    Raises ValueError when a draft model's vocabulary differs from the model's."""
    if config.method == "ngram":
        return NgramDraft(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "custom":
        return config.draft
    draft = config.draft_model
    draft_vocab, vocab = draft.config.vocab_size, model.config.vocab_size
    if draft_vocab != vocab:
        raise ValueError(f"the draft model's vocabulary has {draft_vocab} tokens but the model's has {vocab}; "
                         "a draft must share the model's tokenizer (e.g. a smaller model of the same family)")
    draft_device, device = next(draft.parameters()).device, next(model.parameters()).device
    if draft_device != device:  # its draws use the request's seeded generator, which lives on the model's device
        raise ValueError(f"the draft model is on {draft_device} but the model on {device}; "
                         f"load it with load_model(..., device='{device}')")
    return DraftModel(draft, params, generator, max_seq_len)


def token_probs(logits: torch.Tensor, params: SamplingParams, prompt_ids=None, output_ids=None) -> torch.Tensor:
    """The distribution :func:`~minillm.sampling.sample` draws from: logits [B, vocab] -> probs [B, vocab].

    Penalties (with ``prompt_ids`` / ``output_ids``, [B, T] as in ``sample``), then greedy as
    one-hot on the argmax, else softmax(filter_logits(...)): temperature, min-p, top-k, top-p.
    """
    logits = logits.float()
    if params.has_penalties:
        logits = apply_penalties(logits, params, as_token_ids(prompt_ids, logits), as_token_ids(output_ids, logits))
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # as in sample(): a tiny temperature then gives 0, not NaN
    return torch.softmax(filter_logits(shifted, params), dim=-1)


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
    for i, d in enumerate(draft_ids):
        q_i = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).to(p)
        ratio = p[i, d] / q_i[d]
        if ratio >= 1 or torch.rand((), generator=generator, device=p.device) < ratio:
            continue
        return i, torch.multinomial(residual_distribution(p[i], q_i), 1, generator=generator).item()
    return len(draft_ids), torch.multinomial(p[-1], 1, generator=generator).item()


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected draft's replacement is drawn from: normalize(max(0, p - q)).

    p, q: [vocab] the target's and the draft's distributions at one position. Returns [vocab]
    float, summing to 1: the mass p has beyond q. Rejecting d with probability 1 - min(1, p(d)/q(d))
    takes away exactly q's excess, so drawing the replacement from here gives back p (Leviathan
    et al. 2023, Theorem 1; Chen et al. 2023). When p == q (up to rounding) nothing is left
    and a rejection had probability ~0: p itself is returned.
    """
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return p if total <= 0 else residual / total


def accept_greedy(logits: torch.Tensor, draft_ids: list[int]) -> tuple[int, int]:
    """:func:`accept_or_resample` when p is greedy's one-hot: keep drafts while each is the argmax.

    logits: [k+1, vocab] from :func:`~minillm.phases.verify`. With p one-hot on argmax_i, p_i(d_i)
    is 1 or 0, so d_i is accepted exactly when it equals argmax_i, and the first mismatch's residual
    (or the bonus) is argmax_i itself. One argmax over the k+1 rows: no softmax over the vocabulary.
    Returns (n_accepted, token) as accept_or_resample does.
    """
    best = logits.argmax(dim=-1).tolist()
    n_accepted = 0
    while n_accepted < len(draft_ids) and draft_ids[n_accepted] == best[n_accepted]:
        n_accepted += 1
    return n_accepted, best[n_accepted]


def generate_speculative(model: Transformer, prompt_ids: torch.Tensor, params: SamplingParams, cache: KVCache,
                         eos: set[int], config: SpeculativeConfig, tokenizer=None, trace=None):
    """:func:`~minillm.generate.generate` with speculative decoding; called by it, same steps.

    The first token comes from the prefill as usual; then each round drafts k tokens, verifies
    them in one pass and yields the accepted ones and the target's own token. k shrinks near
    ``max_new_tokens`` and the end of the cache, so no pass writes past them; a stop inside a
    round truncates the cache to where plain decoding would have it. The first step of each
    round carries ``proposed`` / ``accepted``; a round's steps share one ``time_s`` (they arrive
    together, so their inter-token latency is 0).

    With a :class:`~minillm.trace.Trace`: the traced prefill, one "verify" event per round (its
    time, the drafted tokens, how many were accepted, the model's own token and whether it was
    resampled or the bonus, the cache length before the pass and after the truncation) and, at the
    end, a "speculative" event with the request's :class:`SpeculativeStats`. (No per-token
    sampling fields or "metrics" event: the steps' times give those.)
    """
    if cache.batch_size != 1:
        raise ValueError(f"speculative decoding runs one sequence, got a KV cache for batch {cache.batch_size}; "
                         "pass a batch-1 cache or none")
    if cache.rolling_layers:
        # A rejected draft is taken back with truncate, and a rolling buffer has already overwritten
        # the positions the window needs then (refused here, not at the first rejection).
        raise ValueError("speculative decoding takes rejected drafts back out of the KV cache, which a cache with "
                         "rolling buffers cannot do; build it with KVCache.for_model(model, rolling=False)")
    generator = params.make_generator(cache.k.device)
    draft = make_draft(config, model, params, generator, cache.max_seq_len)
    text = TextStream(tokenizer, params.stop) if tokenizer is not None else None
    prompt, output = prompt_ids.tolist(), []
    logits = prefill(model, prompt_ids, cache, trace=trace)
    token, logprob = sample(logits, params, generator, prompt_ids[None], [output])
    emitted, phase, counts = [(token.item(), logprob.item())], "prefill", (None, None)
    rounds: list[tuple[int, int]] = []  # (proposed, accepted) of every round
    k = config.num_speculative_tokens  # the schedule moves it between rounds
    while True:
        known_s = time.perf_counter()  # a round's tokens are all known at once, when its pass ends
        start_length = cache.length - (len(emitted) - 1)  # holds everything before emitted[0]
        for i, (token_id, logprob) in enumerate(emitted):
            output.append(token_id)
            length = start_length + i  # the cache length plain decoding would have now
            reason, stop_reason, piece = check_stop(token_id, len(output), eos, params, length >= cache.max_seq_len,
                                                    text)
            proposed, accepted = counts if i == 0 else (None, None)
            yield GenerationStep(token_id, logprob, phase, length, known_s, reason, prefill_tokens=len(prompt),
                                 text=piece, stop_reason=stop_reason, proposed=proposed, accepted=accepted)
            if reason:
                cache.truncate(length)
                if trace is not None:
                    trace.record("speculative", **SpeculativeStats.from_rounds(rounds).to_dict())
                return
        phase = "decode"
        emitted, counts = _round(model, draft, k, params, generator, cache, prompt, output, trace)
        rounds.append(counts)
        k = config.next_k(k, *counts)


def _round(model, draft: Draft, k: int, params, generator, cache: KVCache, prompt: list[int], output: list[int],
           trace=None):
    """One draft-verify-accept round of at most ``k`` drafts. Returns ([(token, logprob)] to emit,
    (proposed, accepted)). With no proposal the pass is a plain decode step (one row)."""
    room = min(cache.max_seq_len - cache.length - 1, params.max_new_tokens - len(output) - 1)
    k = min(k, room)
    drafted = [int(t) for t in draft.propose(prompt + output, k)[:k]] if k > 0 else []
    q = _checked_q(draft.draft_probs() if drafted else None, len(drafted), model.config.vocab_size)
    start = cache.length
    if trace is None:
        logits = verify(model, [output[-1]] + drafted, cache)
    else:
        with trace.span("verify") as event:
            logits = verify(model, [output[-1]] + drafted, cache)
    if params.greedy and not params.has_penalties:
        n_accepted, token = accept_greedy(logits, drafted)
    else:
        history = output + drafted  # the target's p_i sees the drafts before it (penalties count them)
        p = torch.cat([token_probs(logits[i : i + 1], params, [prompt], [history[: len(output) + i]])
                       for i in range(len(drafted) + 1)])
        n_accepted, token = accept_or_resample(p, None if q is None else q.to(p.device), drafted, generator)
    cache.truncate(start + 1 + n_accepted)  # the last token and the accepted drafts; the new token is not in yet
    tokens = drafted[:n_accepted] + [token]
    if trace is not None:
        _record_verify(event, trace, output[-1], drafted, n_accepted, token, start, cache.length)
    logprobs = torch.log_softmax(logits[: len(tokens)], dim=-1)[torch.arange(len(tokens)), tokens]
    return list(zip(tokens, logprobs.tolist())), (len(drafted), n_accepted)


@dataclass(frozen=True)
class SpeculativeStats:
    """A request's speculation, from its steps (vLLM's spec-decode metrics, per request).

    Attributes:
        num_drafts: verification passes that had at least one proposed token.
        num_draft_tokens: tokens proposed over the request.
        num_accepted_tokens: of those, accepted.
        acceptance_rate: num_accepted_tokens / num_draft_tokens (0 without drafts).
        mean_acceptance_length: tokens per pass with drafts: 1 + accepted / num_drafts
            (vLLM's definition; the one token the target adds counts).
    """

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @classmethod
    def from_steps(cls, steps) -> "SpeculativeStats":
        """From :class:`~minillm.generate.GenerationStep` objects (their ``proposed`` / ``accepted``)."""
        return cls.from_rounds([(s.proposed, s.accepted) for s in steps if s.proposed is not None])

    @classmethod
    def from_rounds(cls, rounds) -> "SpeculativeStats":
        """From (proposed, accepted) pairs, one per verification pass."""
        drafts = [(p, a) for p, a in rounds if p]
        return cls(len(drafts), sum(p for p, _ in drafts), sum(a for _, a in drafts))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def to_dict(self) -> dict:
        """The counts and the two rates, as the trace's "speculative" event and ``--json`` carry them."""
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens, acceptance_rate=self.acceptance_rate,
                    mean_acceptance_length=self.mean_acceptance_length)


def expected_tokens_per_pass(acceptance_rate: float, k: int) -> float:
    """Tokens one verify pass yields on average, if each draft is accepted with probability a.

        E = 1 + a + a² + ... + a^k = (1 - a^(k+1)) / (1 - a)          (k + 1 when a = 1)

    Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
    equation (1). The pass keeps draft i only if drafts 1..i-1 were kept, and always adds one
    token of the target's own (the resample at the first rejection, or the bonus after k
    acceptances): so E runs from 1 (a = 0, or k = 0: plain decoding) to k + 1 (a = 1).
    It assumes every draft is accepted independently with the same a; real acceptances come
    in runs (easy stretches of text accept long runs), so a measured mean acceptance length
    (:attr:`SpeculativeStats.mean_acceptance_length`) is usually above E at the same a.

    Args:
        acceptance_rate: a, the probability that a draft token is accepted, 0 <= a <= 1
            (an int 0 or 1 is fine).
        k: drafts proposed per pass, an integer >= 0.

    Returns E, tokens per pass, a float.
    Raises ValueError for a outside [0, 1] (NaN included), or k not an integer (2.0 is not) or < 0.
    """
    _check_acceptance(acceptance_rate, k)
    a = acceptance_rate
    if a == 1:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


def speculative_speedup(acceptance_rate: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Expected speed-up of speculative decoding over plain decoding: tokens per unit of time.

        speed-up = E / (k · c + v),   E = expected_tokens_per_pass(a, k)

    One pass runs the draft k times (c each, in target decode steps) and one verify pass of
    k + 1 tokens (v target decode steps), and yields E tokens; plain decoding yields 1 token
    per step. With v = 1, Leviathan et al. 2023's assumption that checking k + 1 tokens costs
    one decode step (memory-bound decode), this is their Theorem 3.8, (1 - a^(k+1)) /
    ((1 - a)(k·c + 1)). A measured v above 1 (lesson 09: a verify pass of 1 + 5 tokens on a
    CPU) lowers it. Below 1, speculation slows decoding down.

    Args:
        acceptance_rate: a, 0 <= a <= 1.
        k: drafts per pass, an integer >= 0 (k = 0 is plain decoding: 1 / v).
        draft_cost: c, one draft step's time over one target decode step, finite and >= 0
            (0 for prompt lookup, which runs no model).
        verify_cost: v, a verify pass's time over one target decode step, finite and > 0.

    Returns the speed-up, a float.
    Raises ValueError for a outside [0, 1], k not an integer or < 0, draft_cost < 0 or not
    finite, verify_cost <= 0 or not finite (NaN included).
    """
    _check_acceptance(acceptance_rate, k)
    if not (math.isfinite(draft_cost) and draft_cost >= 0):
        raise ValueError(f"draft_cost must be finite and >= 0 (a draft step over a target step), got {draft_cost}")
    if not (math.isfinite(verify_cost) and verify_cost > 0):
        raise ValueError(f"verify_cost must be finite and > 0 (a verify pass over a decode step), got {verify_cost}")
    return expected_tokens_per_pass(acceptance_rate, k) / (k * draft_cost + verify_cost)


def _check_acceptance(acceptance_rate: float, k: int) -> None:
    if not 0 <= acceptance_rate <= 1:  # False for NaN too
        raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
    if not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"k must be an integer >= 0 (drafts per pass), got {k!r}")


def _record_verify(event, trace, last: int, drafted: list[int], n_accepted: int, token: int, start: int,
                   length: int) -> None:
    """Fill a trace's "verify" event: what was drafted, kept and added, and the cache around it."""
    event.update(position=start, input_token_id=last, drafted=drafted, proposed=len(drafted), accepted=n_accepted,
                 token_id=token, how="resampled" if n_accepted < len(drafted) else "bonus" if drafted else "decode",
                 cache_length_before=start, cache_length_verified=start + 1 + len(drafted), cache_length_after=length)
    if trace.tokenizer is not None:
        event.update(drafted_text=trace.tokenizer.token_strings(drafted) if drafted else [],
                     token_text=trace.tokenizer.token_strings([token])[0])


def _checked_q(q: torch.Tensor | None, n_drafted: int, vocab: int) -> torch.Tensor | None:
    """A draft's q as the verifier needs it, [n_drafted, vocab] (its first rows if it proposed more)."""
    if q is None:
        return None
    if q.dim() != 2 or q.shape[0] < n_drafted or q.shape[1] != vocab:
        raise ValueError(f"draft_probs() must be [n_proposed, vocab] = [{n_drafted}, {vocab}] (a row per proposed "
                         f"token), got {list(q.shape)}; return None for a deterministic draft")
    return q[:n_drafted].float()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n

