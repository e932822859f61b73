"""generate(): prefill once, then decode_step in a loop, one token at a time.

    prompt ids --prefill--> logits --sample--> token 1   (phase "prefill": its time is TTFT)
    token 1   --decode---> logits --sample--> token 2   (phase "decode": the gaps are TPOT)
    ...                                                 until EOS, a stop id, a stop string,
                                                        max_new_tokens, or a full KV cache

It is a Python generator, so a CLI can print each token as it comes and a
notebook can step through a request with ``next()``. Given a tokenizer, each step
also carries the text it adds, with stop strings cut out. When to stop and the text
shown are minillm/stopping.py's, shared with speculative decoding and the serving engine.

The loop is the lesson's (exercise 14 writes it); what minillm adds around it is a small
helper each, below it in this file: the prefix cache (:class:`_CachedPrefix`), constrained
decoding (:class:`_Grammar`), the trace (:func:`_record_token`) and speculative decoding
(:func:`_speculative`, which hands the whole request to minillm/speculative.py).
"""

from __future__ import annotations

import numbers
import time
from typing import Iterator

import torch

from .errors import CacheFullError
from .generation_config import generation_config_of
from .kv_cache import KVCache
from .model import Transformer
from .phases import decode_step, prefill
from .prefix_cache import PrefixCache
from .sampling import SamplingParams, sample_constrained
from .speculative import SpeculativeConfig, generate_speculative
from .stopping import GenerationStep, TextStream, check_stop  # GenerationStep: minillm.generate's public name too


def generate(
    model: Transformer,
    prompt_ids,
    params: SamplingParams | None = None,
    cache: KVCache | None = None,
    eos_token_ids=None,
    prefix_cache: PrefixCache | None = None,
    trace=None,
    tokenizer=None,
    speculative: SpeculativeConfig | None = None,
) -> Iterator[GenerationStep]:
    """Generate tokens for one prompt: prefill once, then sample and decode_step until a stop.

    Args:
        model: the transformer.
        prompt_ids: the prompt, [T] or [1, T] int64 (or a list of ints), T >= 1.
        params: sampling (temperature, top_k, top_p, seed, penalties) and stopping (max_new_tokens,
            stop_token_ids, stop). Default: the checkpoint's generation_config.json defaults
            (see :mod:`minillm.generation_config`), else greedy, 256 tokens.
        cache: a batch-1 KV cache with room for the prompt; it may already hold a prefix (the
            prompt then continues after it). Default: a fresh one sized
            min(model context, T + max_new_tokens).
        eos_token_ids: ids that end generation (a set, a list or one id); default the checkpoint's
            (generation_config.json's eos_token_id, else config.json's).
        prefix_cache: a :class:`~minillm.prefix_cache.PrefixCache`: the prompt's cached prefix is
            copied into ``cache`` (which must then be empty) and only the rest is prefilled; the
            prompt's full blocks are inserted after the prefill. The blocks used stay locked
            until the generator finishes or is closed.
        trace: a :class:`~minillm.trace.Trace` to record the prefill, each decode step (with the
            top next-token candidates and how the token was chosen) and, with the last token,
            the request's metrics (and, given a tokenizer, the "detokenize" event).
        tokenizer: a :class:`~minillm.tokenizer.Tokenizer`; each step then carries its ``text``.
            Needed for ``params.stop`` (stop strings are matched on text).
        speculative: a :class:`~minillm.speculative.SpeculativeConfig`: a draft proposes tokens and
            the model verifies several per pass (minillm/speculative.py); the same tokens (greedy)
            or the same distribution (sampling). Not with ``prefix_cache`` yet; a ``trace`` gets the
            prefill and one "verify" event per pass.
        (``params.allowed_tokens``, constrained decoding: the request's matcher gives each step's
        allowed tokens and is told each token; the trace's events then carry ``allowed_tokens``.)

    Yields one :class:`GenerationStep` per token, with token_id, logprob, phase ("prefill" for
    the first token, "decode" after), cache_length (``cache.length`` after the forward pass that
    produced the token), time_s (``time.perf_counter()`` once the token is known), finish_reason,
    cached_tokens (prompt tokens the prefix cache served, else 0) and prefill_tokens (T minus
    those). The finish reason is None until the last step, which has the first that applies of:
    "eos" (the token is an EOS id), "stop" (one of params.stop_token_ids), "length"
    (max_new_tokens tokens generated), "cache_full" (no room left to decode the token); a stop
    string found in the text makes it "stop" too. The last token is not decoded: nothing would
    use its logits. For batched decoding call :func:`prefill` and :func:`decode_step` directly.

    Raises ValueError (text instead of ids, an empty or batched prompt, stop strings without a
    tokenizer, bad eos ids, a bad ``speculative``), CacheFullError (the prompt does not fit).
    """
    prompt_ids, params, cache, eos = _checked_request(model, prompt_ids, params, cache, eos_token_ids, tokenizer)
    if speculative is not None:
        yield from _speculative(model, prompt_ids, params, cache, eos, speculative, tokenizer, prefix_cache, trace)
        return
    generator = params.make_generator(cache.k.device)  # made once: the seed starts one stream of draws
    text = TextStream(tokenizer, params.stop) if tokenizer is not None else None
    grammar = _Grammar(params)
    prefix = _CachedPrefix(prefix_cache, model, prompt_ids, cache, trace)  # locks the blocks it copies in
    try:
        logits = prefill(model, prompt_ids[prefix.cached_tokens:], cache, trace=trace)  # a cache hit: only the rest
        prefix.insert(cache)
        output_ids, phase = [], "prefill"
        for n in range(1, params.max_new_tokens + 1):
            token, logprob = grammar.sample(logits, params, generator, prompt_ids, output_ids)
            token_id = token.item()  # waits for the device: the token is now really known
            output_ids.append(token_id)
            grammar.accept(token_id)
            now = time.perf_counter()
            reason, stop_reason, piece = check_stop(token_id, n, eos, params, cache.length >= cache.max_seq_len, text)
            step = GenerationStep(token_id, logprob.item(), phase, cache.length, now, reason,
                                  cached_tokens=prefix.cached_tokens, prefill_tokens=prefix.prefill_tokens,
                                  text=piece, stop_reason=stop_reason)
            _record_token(trace, logits, step, params, grammar, text, len(prompt_ids), n)
            yield step
            if reason:
                return
            logits = decode_step(model, token, cache, trace=trace)
            phase = "decode"
    finally:  # also when the caller stops iterating early (generator close)
        prefix.release()


# -- the helpers around the loop -------------------------------------------------------------------


def _checked_request(model: Transformer, prompt_ids, params, cache, eos_token_ids, tokenizer):
    """(prompt_ids [T] int64, params, cache, eos id set): the arguments checked, the defaults filled in."""
    prompt_ids = check_prompt(prompt_ids)
    params = check_params(model, params, tokenizer)
    if len(prompt_ids) > model.config.max_seq_len:
        raise CacheFullError(
            f"the prompt is {len(prompt_ids)} tokens but the model's context is {model.config.max_seq_len} "
            "(prompt and output together); shorten the prompt"
        )
    if cache is None:
        max_seq_len = min(model.config.max_seq_len, len(prompt_ids) + params.max_new_tokens)
        cache = KVCache.for_model(model, max_seq_len=max(max_seq_len, 1))
    return prompt_ids, params, cache, eos_token_set(model, eos_token_ids)


class _CachedPrefix:
    """One request's use of a prefix cache, or nothing without one (``cached_tokens`` is then 0;
    ``prefill_tokens``, the prompt tokens left to prefill, the whole prompt).

        begin:    look the prompt up, lock the hit blocks, copy their K/V into the empty cache
        insert:   after the prefill, put the prompt's full blocks in (locked too)
        release:  unlock them all (when the generator ends or is closed)
    """

    def __init__(self, prefix_cache: PrefixCache | None, model: Transformer, prompt_ids: torch.Tensor,
                 cache: KVCache, trace=None):
        self.prefix_cache, self.model, self.trace = prefix_cache, model, trace
        self.request = prefix_cache.begin(model, prompt_ids, cache, trace=trace) if prefix_cache is not None else None
        self.cached_tokens = self.request.cached_tokens if self.request is not None else 0
        self.prefill_tokens = len(prompt_ids) - self.cached_tokens

    def insert(self, cache: KVCache) -> None:
        if self.request is not None:
            self.prefix_cache.commit(self.model, self.request, cache, trace=self.trace)

    def release(self) -> None:
        if self.request is not None:
            self.prefix_cache.end(self.request)


class _Grammar:
    """Constrained decoding around sample(): ``params.allowed_tokens``' matcher says which ids
    each step allows and is told each token chosen. Without one, :meth:`sample` is
    :func:`~minillm.sampling.sample` (after ``params.logit_bias``, if any)."""

    def __init__(self, params: SamplingParams):
        self.matcher = params.allowed_tokens.matcher() if params.allowed_tokens is not None else None
        self.allowed: torch.Tensor | None = None  # the last step's mask [vocab], bool

    def sample(self, logits: torch.Tensor, params: SamplingParams, generator, prompt_ids: torch.Tensor,
               output_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [1], logprob [1]) from ``logits`` [1, vocab], among the tokens the grammar allows."""
        self.allowed = self.matcher.allowed() if self.matcher is not None else None
        return sample_constrained(logits, params, generator, prompt_ids[None], [output_ids], self.allowed)

    def accept(self, token_id: int) -> None:
        if self.matcher is not None:
            self.matcher.accept(token_id)

    @property
    def n_allowed(self) -> int | None:
        """How many ids the last mask allowed (the trace's ``allowed_tokens``); None without a grammar."""
        return None if self.allowed is None else int(self.allowed.sum())


def _record_token(trace, logits: torch.Tensor, step: GenerationStep, params: SamplingParams, grammar: _Grammar,
                  text: TextStream | None, n_prompt: int, n_generated: int) -> None:
    """The trace's record of one token: how it was sampled (on the pass that made ``logits``)
    and, with the last token, the request's metrics and the time spent detokenizing."""
    if trace is None:
        return
    trace.record_sample(logits, step.token_id, params, step.time_s, step.finish_reason, n_allowed=grammar.n_allowed)
    if step.finish_reason:
        trace.record_metrics(n_prompt, step.finish_reason)
    if step.finish_reason and text:
        trace.record("detokenize", time_ms=text.time_s * 1e3, n_tokens=n_generated, text=text.text)


def _speculative(model, prompt_ids, params, cache, eos, speculative, tokenizer, prefix_cache, trace):
    """Checks, then :func:`minillm.speculative.generate_speculative`."""
    if not isinstance(speculative, SpeculativeConfig):
        raise ValueError(f"speculative must be a SpeculativeConfig, got {type(speculative).__name__}; "
                         "write SpeculativeConfig(method='ngram', num_speculative_tokens=5)")
    if prefix_cache is not None:
        raise ValueError("speculative decoding does not take a prefix_cache yet; drop one of them")
    if params.allowed_tokens is not None or params.logit_bias:
        raise ValueError("speculative decoding does not take allowed_tokens or logit_bias yet; drop one of them")
    return generate_speculative(model, prompt_ids, params, cache, eos, speculative, tokenizer, trace)


# -- the checks, shared with the serving engine --------------------------------------------------


def check_prompt(prompt_ids) -> torch.Tensor:
    """The prompt as [T] int64; text, a batch, floats or nothing are refused with the fix."""
    if isinstance(prompt_ids, str):
        raise ValueError("generate() takes token ids, not text; encode it first: generate(model, tok.encode(text))")
    try:
        ids = prompt_ids if isinstance(prompt_ids, torch.Tensor) else torch.tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError):  # None, ragged lists, strings inside lists
        raise ValueError(f"prompt_ids must be a list of token ids or an integer tensor, got {prompt_ids!r:.60}") from None
    if ids.dtype not in (torch.int64, torch.int32) and ids.numel():
        raise ValueError(f"prompt_ids must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 2 and ids.shape[0] != 1:
        raise ValueError(f"generate() runs one prompt, got a batch of shape {tuple(ids.shape)}; for a batch call "
                         "prefill and decode_step with [B, T] ids and a KVCache.for_model(model, batch_size=B)")
    if ids.dim() > 2:
        raise ValueError(f"prompt_ids must be [T] or [1, T], got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. the BOS id)")
    return ids.reshape(-1).long()


def check_params(model: Transformer, params, tokenizer) -> SamplingParams:
    """``params``, or the checkpoint's defaults for None; ValueError for a non-SamplingParams
    or for stop strings without a tokenizer (they are matched on text)."""
    if params is None:
        params = generation_config_of(model).sampling_params()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}; "
                         "write SamplingParams(temperature=..., ...)")
    if params.stop and tokenizer is None:
        raise ValueError(f"stop strings {list(params.stop)} are matched on text: pass tokenizer= to generate()")
    vocab = model.config.vocab_size
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise ValueError(f"logit_bias names token {max(params.logit_bias)}, not in the vocabulary (ids 0..{vocab - 1})")
    return params


def eos_token_set(model: Transformer, eos_token_ids) -> set[int]:
    """The ids that end generation: ``eos_token_ids`` (an id or a list), default the checkpoint's."""
    if eos_token_ids is None:
        return set(generation_config_of(model).eos_token_ids)
    ids = [eos_token_ids] if isinstance(eos_token_ids, numbers.Integral) else eos_token_ids
    if isinstance(ids, (str, bytes)) or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_ids must be a token id or a list of them, got {eos_token_ids!r}")
    return {int(i) for i in ids}
