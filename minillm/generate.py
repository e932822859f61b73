"""generate(): prefill once, then decode_step in a loop, one token at a time.

    prompt ids --prefill--> logits --sample--> token 1   (phase "prefill": its time is TTFT)
    token 1   --decode---> logits --sample--> token 2   (phase "decode": the gaps are TPOT)
    ...                                                 until EOS, a stop id, a stop string,
                                                        max_new_tokens, or a full KV cache

It is a Python generator, so a CLI can print each token as it comes and a
notebook can step through a request with ``next()``. Given a tokenizer, each step
also carries the text it adds, with stop strings cut out. When to stop and the text
shown are minillm/stopping.py's, shared with speculative decoding and the serving engine.
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
    """Generate tokens for one prompt, yielding a :class:`GenerationStep` per token.

    Args:
        model: the transformer.
        prompt_ids: the prompt, [T] or [1, T] int64 (or a list of ints), T >= 1.
        params: sampling and stopping. Default: the checkpoint's generation_config.json
            defaults (see :mod:`minillm.generation_config`), else greedy, 256 tokens.
        cache: a batch-1 KV cache to fill; default a fresh one sized
            min(model context, T + max_new_tokens). Passing a cache that already
            holds a prefix continues from it.
        eos_token_ids: ids that end generation; default the checkpoint's (generation_config.json's
            eos_token_id, else config.json's).
        prefix_cache: a :class:`~minillm.prefix_cache.PrefixCache`: the prompt's cached
            prefix is copied into ``cache`` (which must then be empty) and only the rest is
            prefilled; the prompt's full blocks are inserted after the prefill. The blocks
            used stay locked until the generator finishes or is closed. Every step reports
            ``cached_tokens`` and ``prefill_tokens``.
        trace: a :class:`~minillm.trace.Trace` to record the prefill, each decode step
            (with the top next-token candidates and how the token was chosen) and, with
            the last token, the request's metrics (and, given a tokenizer, the "detokenize"
            event). None (default): nothing is recorded.
        tokenizer: a :class:`~minillm.tokenizer.Tokenizer`; each step then carries its
            ``text``. Needed for ``params.stop`` (stop strings are matched on text).
        (``params.allowed_tokens``, constrained decoding: the request's matcher gives each step's
        allowed tokens and is told each token; the trace's events then carry ``allowed_tokens``.)
        speculative: a :class:`~minillm.speculative.SpeculativeConfig`: a draft proposes
            tokens and the model verifies several per pass (minillm/speculative.py); the steps
            are the same tokens (greedy) or the same distribution (sampling). Not with
            ``prefix_cache`` yet; a ``trace`` gets the prefill and one "verify" event per pass.
            None (default): one token per decode step.

    The last yielded step carries the ``finish_reason``. For batched decoding call
    :func:`prefill` and :func:`decode_step` directly, with [B, T] ids.

    Raises ValueError (text instead of ids, an empty or batched prompt, stop strings
    without a tokenizer, bad eos ids, a bad ``speculative``), CacheFullError (the prompt does not fit).
    """
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
    eos = eos_token_set(model, eos_token_ids)
    if speculative is not None:
        yield from _speculative(model, prompt_ids, params, cache, eos, speculative, tokenizer, prefix_cache, trace)
        return
    generator = params.make_generator(cache.k.device)
    text = TextStream(tokenizer, params.stop) if tokenizer is not None else None
    output_ids: list[int] = []
    matcher = params.allowed_tokens.matcher() if params.allowed_tokens is not None else None

    request = prefix_cache.begin(model, prompt_ids, cache, trace=trace) if prefix_cache is not None else None
    cached = request.cached_tokens if request else 0
    try:
        logits = prefill(model, prompt_ids[cached:], cache, trace=trace)  # with a prefix cache hit: only the suffix
        if request:
            prefix_cache.commit(model, request, cache, trace=trace)
        phase = "prefill"
        for n in range(1, params.max_new_tokens + 1):
            allowed = matcher.allowed() if matcher is not None else None  # constrained decoding: the grammar's mask
            # sample(), after the mask and logit_bias when there are any (sample() itself when not)
            token, logprob = sample_constrained(logits, params, generator, prompt_ids[None], [output_ids], allowed)
            token_id = token.item()  # waits for the device: the token is now really known
            output_ids.append(token_id)
            if matcher is not None:
                matcher.accept(token_id)
            now = time.perf_counter()
            reason, stop_reason, piece = check_stop(token_id, n, eos, params, cache.length >= cache.max_seq_len, text)
            if trace is not None:
                trace.record_sample(logits, token_id, params, now, reason,
                                    n_allowed=None if allowed is None else int(allowed.sum()))
                if reason:
                    trace.record_metrics(len(prompt_ids), reason)
                if reason and text:
                    trace.record("detokenize", time_ms=text.time_s * 1e3, n_tokens=n, text=text.text)
            yield GenerationStep(token_id, logprob.item(), phase, cache.length, now, reason,
                                 cached_tokens=cached, prefill_tokens=len(prompt_ids) - cached,
                                 text=piece, stop_reason=stop_reason)
            if reason:
                return
            logits = decode_step(model, token, cache, trace=trace)
            phase = "decode"
    finally:  # also when the caller stops iterating early (generator close)
        if request:
            prefix_cache.end(request)


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
