"""Turning logits into the next token: penalties, greedy, temperature, min-p, top-k and top-p.

Order of operations (vLLM's v1 sampler, vllm/v1/sample/sampler.py):

    raw logits [B, vocab] -> float32
      -> allowed-token mask: -inf where a constraint (a grammar, constrained decoding) forbids
      -> logit_bias: added to chosen tokens' logits (OpenAI's logit_bias)
      -> penalties: repetition (prompt + output tokens), presence and frequency (output tokens)
      -> greedy (temperature < 1e-5): argmax, stop here
      -> / temperature -> min_p -> top_k -> top_p -> softmax -> draw one token

Temperature comes BEFORE top-k/top-p: they filter the distribution temperature has
already reshaped. Penalties come before greedy, so they change greedy output too.
min-p before top-k/top-p is vLLM's place for it; transformers applies it after them
(the kept set differs only when min_p and top_p are both set). The mask comes first, as vLLM
applies its grammar bitmask to the logits before its sampler: a forbidden token then has
probability 0 whatever comes after, and greedy picks the best allowed one.

Constrained decoding (structured output) is a plain hook here: ``SamplingParams.allowed_tokens``
is any object with a ``matcher()`` method giving each sequence its own :class:`TokenMatcher`,
which says before each token which ids are allowed and is told each token chosen. This module
knows nothing of grammars; minillm/structured/ builds such objects from a JSON schema, a
regex or a list of choices with a grammar library.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Protocol, runtime_checkable

import torch

# vLLM's _SAMPLING_EPS: a temperature below it is greedy. Dividing logits by a smaller one
# only overflows float32, and the distribution is already one-hot on the argmax.
GREEDY_TEMPERATURE = 1e-5


@runtime_checkable
class TokenMatcher(Protocol):
    """One sequence's constraint state: which tokens may come next, advanced token by token."""

    def allowed(self) -> torch.Tensor:
        """A bool tensor [vocab]: True where the next token may be that id."""

    def accept(self, token_id: int) -> None:
        """Move past ``token_id``, the token just chosen (always one :meth:`allowed` allowed)."""


@runtime_checkable
class AllowedTokens(Protocol):
    """A constraint shared by requests (e.g. a compiled JSON schema); each sequence gets its own matcher."""

    def matcher(self) -> TokenMatcher:
        """A fresh :class:`TokenMatcher`, at the start of the output."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Names and meanings are vLLM's ``SamplingParams``.

    Attributes:
        temperature: >= 0. 0 (or anything below 1e-5, as in vLLM) is greedy (argmax); 1 samples
            the model's distribution; higher flattens it, lower sharpens it.
        top_k: >= 0. Keep only the k most likely tokens; 0 (or vLLM's -1) disables.
        top_p: in (0, 1]. Nucleus sampling (Holtzman et al. 2019): keep the smallest set of
            most likely tokens whose probabilities sum to at least top_p; 1 disables.
        min_p: in [0, 1]. Keep tokens whose probability is at least min_p times the top
            token's (Nguyen et al. 2024, "min-p sampling"); 0 disables.
        repetition_penalty: > 0. Tokens already in the prompt or the output have positive
            logits divided by it and negative ones multiplied (CTRL, Keskar et al. 2019);
            1 disables, > 1 discourages repeats.
        presence_penalty: in [-2, 2]. Subtracted once from the logit of every token that
            appears in the output so far (OpenAI's definition); 0 disables.
        frequency_penalty: in [-2, 2]. Subtracted from a token's logit once per time it
            appears in the output so far; 0 disables.
        seed: seed of the random generator; the same seed gives the same output.
        max_new_tokens: >= 1, the most tokens to generate. (``max_tokens=``, vLLM's name, still
            works but warns: DeprecationWarning; the OpenAI server's ``max_tokens`` field maps to it.)
        stop_token_ids: token ids that end generation (besides the model's EOS); the token
            is part of the output.
        stop: strings that end generation; the text stops just before the first one found
            and never shows it (vLLM's ``include_stop_str_in_output=False``). A single
            string is one stop string. Needs a tokenizer in :func:`~minillm.generate.generate`.
        ignore_eos: True: the model's EOS ids do not end generation, so it runs to
            max_new_tokens (vLLM's ``ignore_eos``, for benchmarks); stop ids and strings still do.
        logit_bias: {token id: bias}, each bias in [-100, 100], added to that token's logit
            before penalties and sampling (OpenAI's ``logit_bias``): -100 in effect bans a
            token, +100 in effect forces it. None or {} disables.
        allowed_tokens: None, or an :class:`AllowedTokens` (constrained decoding): each sequence
            asks its matcher before every token which ids are allowed (the others get -inf,
            before everything else) and tells it each token chosen. minillm.structured makes
            them from a JSON schema, a regex or choices; any object with ``matcher()`` works.
            Both are applied by :func:`sample_constrained`, which ``generate`` and the engine call;
            :func:`sample` itself (the lesson's) reads only the logits it is given.

    Raises ValueError naming the parameter, its allowed values and what it got.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_tokens: AllowedTokens | None = None
    max_tokens: InitVar[int | None] = None

    def __post_init__(self, max_tokens):
        if max_tokens is not None:  # vLLM's spelling of max_new_tokens: deprecated, one name is enough
            warnings.warn(f"SamplingParams(max_tokens=...) is deprecated: write max_new_tokens={max_tokens!r} "
                          "(minillm's one name for the token limit)", DeprecationWarning, stacklevel=3)
            if self.max_new_tokens not in (256, max_tokens):
                raise ValueError(f"max_tokens ({max_tokens}) and max_new_tokens ({self.max_new_tokens}) are the "
                                 "same knob (vLLM's and minillm's names); give only max_new_tokens")
            object.__setattr__(self, "max_new_tokens", max_tokens)
        checked = {
            "temperature": _real(self.temperature, "temperature", 0, math.inf, "a finite number >= 0 (0 = greedy)"),
            "top_k": _integer(self.top_k, "top_k", -1, None, "an integer >= 0 (0 or -1 = off)"),
            "top_p": _real(self.top_p, "top_p", 0, 1, "in (0, 1] (1 = off)", low_open=True),
            "min_p": _real(self.min_p, "min_p", 0, 1, "in [0, 1] (0 = off)"),
            "repetition_penalty": _real(self.repetition_penalty, "repetition_penalty", 0, math.inf,
                                        "a finite number > 0 (1 = off)", low_open=True),
            "presence_penalty": _real(self.presence_penalty, "presence_penalty", -2, 2, "in [-2, 2] (0 = off)"),
            "frequency_penalty": _real(self.frequency_penalty, "frequency_penalty", -2, 2, "in [-2, 2] (0 = off)"),
            "seed": None if self.seed is None else _integer(self.seed, "seed", 0, 2**63 - 1, "an integer in [0, 2**63)"),
            "max_new_tokens": _integer(self.max_new_tokens, "max_new_tokens", 1, None, "an integer >= 1"),
            "stop_token_ids": _token_ids(self.stop_token_ids),
            "stop": _stop_strings(self.stop),
        }
        checked["logit_bias"] = _logit_bias(self.logit_bias)
        if self.allowed_tokens is not None and not callable(getattr(self.allowed_tokens, "matcher", None)):
            raise ValueError("allowed_tokens must be None or an object with a matcher() method (see "
                             f"minillm.sampling.AllowedTokens), got {type(self.allowed_tokens).__name__}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        checked["top_k"] = max(checked["top_k"], 0)  # vLLM's -1 = off is minillm's 0
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax: temperature below 1e-5 (vLLM's threshold)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def is_plain(self) -> bool:
        """True when the token depends on the logits alone: no penalties, bias or constraint
        (such greedy rows can share one batched argmax)."""
        return not (self.has_penalties or self.logit_bias or self.allowed_tokens is not None)

    def make_generator(self, device) -> torch.Generator | None:
        """A seeded torch.Generator for ``device``, or None (global RNG) when no seed is set."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def _real(value, name: str, low: float, high: float, allowed: str, low_open: bool = False) -> float:
    """``value`` as a float in [low, high] ((low, high] with low_open); ValueError otherwise.
    Accepts any real number type (int, float, numpy scalars), never a bool or a string."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = (low < value if low_open else low <= value) and value <= high and math.isfinite(value)
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def _integer(value, name: str, low: int, high: int | None, allowed: str) -> int:
    """``value`` as an int in [low, high]; any integer type (numpy's too), never a bool or a float."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok:
        value = int(value)
        ok = low <= value and (high is None or value <= high)
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def _token_ids(ids) -> tuple[int, ...]:
    ids = () if ids is None else ids
    is_list = hasattr(ids, "__iter__") and not isinstance(ids, (str, bytes))
    ids = list(ids) if is_list else ids
    if not (is_list and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids)):
        hint = f" (for text, use stop=[{ids!r}])" if isinstance(ids, str) else ""
        raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}{hint}")
    return tuple(int(i) for i in ids)


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id (int >= 0): bias (float in [-100, 100])}, or None when empty."""
    if bias is None or (isinstance(bias, dict) and not bias):
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {bias!r:.80}")
    checked = {}
    for token_id, value in bias.items():
        token_id = _integer(token_id, "a logit_bias token id", 0, None, "an integer >= 0")
        checked[token_id] = _real(value, f"logit_bias[{token_id}]", -100, 100, "a number in [-100, 100]")
    return checked


def _stop_strings(stop) -> tuple[str, ...]:
    stop = () if stop is None else stop
    stop = (stop,) if isinstance(stop, str) else stop
    stop = list(stop) if hasattr(stop, "__iter__") and not isinstance(stop, bytes) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return tuple(stop)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: torch.Tensor,
                    output_ids: torch.Tensor) -> torch.Tensor:
    """Repetition, presence and frequency penalties, with vLLM's meanings (model_executor/layers/utils.py).

    Args:
        logits: [B, vocab] float32.
        prompt_ids: [B, T_prompt] int64, the prompt tokens (only the repetition penalty reads them).
        output_ids: [B, T_out] int64, the tokens generated so far (T_out may be 0).

    Returns new logits [B, vocab]: for tokens seen in prompt or output, ``z / r`` where z > 0 and
    ``z * r`` where z <= 0 (as transformers' RepetitionPenaltyLogitsProcessor); then
    ``z - frequency_penalty * count - presence_penalty * (count > 0)`` over output counts.
    A finite logit stays finite (clamped to float32's range), a -inf one stays -inf.
    """
    counts = torch.zeros_like(logits).scatter_add_(-1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    seen = counts > 0
    penalized = logits
    if params.repetition_penalty != 1:
        in_prompt = torch.zeros_like(seen).scatter_(-1, prompt_ids, True)
        r = params.repetition_penalty
        scaled = torch.where(logits > 0, logits / r, logits * r)
        penalized = torch.where(seen | in_prompt, scaled, logits)
    penalized = penalized - params.frequency_penalty * counts - params.presence_penalty * seen.to(logits.dtype)
    finfo = torch.finfo(logits.dtype)
    return torch.where(torch.isfinite(logits), penalized.clamp(finfo.min, finfo.max), logits)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, min-p, top-k and top-p to logits [B, vocab] (float32), in that order.

    Removed tokens get -inf. The token that first crosses the top_p threshold is kept,
    and the most likely token is always kept. Tied logits at the k-th place are all kept
    (as in vLLM and transformers). :func:`sample` shifts the logits so that the largest is 0
    first, which keeps a small temperature from overflowing to +inf.
    """
    # A temperature above float32's largest value would become inf there (and -inf / inf is NaN);
    # at that size the distribution is already uniform over the finite logits.
    logits = logits / min(params.temperature, torch.finfo(torch.float32).max)
    if params.min_p > 0:  # vLLM / transformers MinPLogitsWarper: probs < min_p * max prob removed
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
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
        drop_sorted[:, 0] = False  # the most likely token stays, even for a top_p below float32's smallest
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def apply_allowed_and_bias(logits: torch.Tensor, params: SamplingParams,
                           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The allowed-token mask, then ``params.logit_bias``, on logits [B, vocab] (float32).

    ``allowed``: None, or bool [B, vocab] (or [vocab]): False -> -inf, the token cannot be picked.
    Raises ValueError when a row allows no token at all.
    """
    if allowed is not None:
        allowed = allowed.to(device=logits.device, dtype=torch.bool).expand_as(logits)
        if not allowed.any(dim=-1).all():
            raise ValueError("the allowed-token mask allows no token at all for a row (the constraint "
                             "cannot continue: check the grammar and the EOS ids it was given)")
        logits = logits.masked_fill(~allowed, float("-inf"))
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if int(ids.max()) >= logits.shape[-1]:
            raise ValueError(f"logit_bias names token {int(ids.max())}, beyond the vocabulary ({logits.shape[-1]})")
        logits = logits.index_add(-1, ids, bias.expand(logits.shape[0], -1))  # -inf + bias stays -inf
    return logits


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
    logits = logits.float()
    _check_logits(logits)
    raw = logits
    if params.has_penalties:
        logits = apply_penalties(logits, params, as_token_ids(prompt_ids, logits), as_token_ids(output_ids, logits))
    if params.greedy:
        token_ids = logits.max(dim=-1).indices  # argmax's token (the first of equal maxima); on a CPU 2.5x faster
    else:
        # Shift so that the largest logit is 0 (softmax ignores a shift): divided by a tiny
        # temperature, the others then go to -inf (probability 0), never +inf (NaN).
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(filter_logits(shifted, params), dim=-1)
        token_ids = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    logprobs = torch.log_softmax(raw, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)
    return token_ids, logprobs


def sample_constrained(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                       prompt_ids=None, output_ids=None, allowed: torch.Tensor | None = None):
    """:func:`sample`, after the allowed-token mask and ``params.logit_bias`` (:func:`apply_allowed_and_bias`).

    ``allowed``: None, or a bool tensor [B, vocab] ([vocab] for B = 1): the tokens the sequence's
    constraint allows now (its :meth:`TokenMatcher.allowed`); the others are never picked.
    Returns (token_ids [B], logprobs [B]) as :func:`sample` does: the logprob is the chosen token's
    under the model's own distribution (the raw logits, before the mask and the bias), as vLLM
    reports it. Without a mask or a bias it is :func:`sample` itself.
    """
    if allowed is None and not params.logit_bias:
        return sample(logits, params, generator, prompt_ids, output_ids)
    logits = logits.float()
    _check_logits(logits)
    token_ids, _ = sample(apply_allowed_and_bias(logits, params, allowed), params, generator, prompt_ids, output_ids)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)
    return token_ids, logprobs


def _check_logits(logits: torch.Tensor) -> None:
    # One pass: a row's max is NaN if it holds a NaN, +inf if it holds +inf, -inf if nothing is finite.
    # Checked before penalties, which could clamp a +inf away: these come from a broken model or mask.
    if not torch.isfinite(logits.amax(dim=-1)).all():
        raise ValueError("logits must be finite or -inf, with a finite value in every row; "
                         "got NaN, +inf or an all -inf row (check the model's dtype and any mask applied)")


def as_token_ids(ids, logits: torch.Tensor) -> torch.Tensor:
    """Token ids as [B, T] int64 on the logits' device; None is no tokens."""
    if ids is None:
        return torch.zeros(logits.shape[0], 0, dtype=torch.long, device=logits.device)
    ids = torch.as_tensor(ids, dtype=torch.long, device=logits.device)
    return ids.reshape(logits.shape[0], -1)
