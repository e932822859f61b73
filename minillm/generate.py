"""generate(): prefill once, then decode_step in a loop, one token at a time.

    prompt ids --prefill--> logits --sample--> token 1   (phase "prefill": its time is TTFT)
    token 1   --decode---> logits --sample--> token 2   (phase "decode": the gaps are TPOT)
    ...                                                 until EOS, a stop id, max_new_tokens,
                                                        or a full KV cache

It is a Python generator, so a CLI can print each token as it comes and a
notebook can step through a request with ``next()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from .errors import CacheFullError
from .kv_cache import KVCache
from .model import Transformer
from .phases import decode_step, prefill
from .prefix_cache import PrefixCache
from .sampling import SamplingParams, sample


@dataclass(frozen=True)
class GenerationStep:
    """One generated token.

    Attributes:
        token_id: the token.
        logprob: its log-probability under the model (natural log).
        phase: "prefill" for the first token (from the prompt's logits), "decode" after.
        cache_length: positions in the KV cache after the forward pass that produced it.
        time_s: ``time.perf_counter()`` when the token was known (seconds).
        finish_reason: None while generating; on the last step "eos", "stop"
            (a stop id), "length" (max_new_tokens) or "cache_full".
        cached_tokens: prompt tokens whose K/V came from the prefix cache (0 without
            one); the same on every step of a request.
        prefill_tokens: prompt tokens the prefill computed (the prompt minus cached_tokens).
    """

    token_id: int
    logprob: float
    phase: str
    cache_length: int
    time_s: float
    finish_reason: str | None = None
    cached_tokens: int = 0
    prefill_tokens: int = 0


def generate(
    model: Transformer,
    prompt_ids,
    params: SamplingParams | None = None,
    cache: KVCache | None = None,
    eos_token_ids=None,
    prefix_cache: PrefixCache | None = None,
    trace=None,
) -> Iterator[GenerationStep]:
    """Generate tokens for one prompt, yielding a :class:`GenerationStep` per token.

    Args:
        model: the transformer.
        prompt_ids: the prompt, [T] int64 (or a list of ints), T >= 1.
        params: sampling and stopping (default: greedy, 256 tokens).
        cache: a batch-1 KV cache to fill; default a fresh one sized
            min(model context, T + max_new_tokens). Passing a cache that already
            holds a prefix continues from it.
        eos_token_ids: ids that end generation; default the model config's eos ids.
        prefix_cache: a :class:`~minillm.prefix_cache.PrefixCache`: the prompt's cached
            prefix is copied into ``cache`` (which must then be empty) and only the rest is
            prefilled; the prompt's full blocks are inserted after the prefill. The blocks
            used stay locked until the generator finishes or is closed. Every step reports
            ``cached_tokens`` and ``prefill_tokens``.
        trace: a :class:`~minillm.trace.Trace` to record the prefill, each decode step
            (with the top next-token candidates and how the token was chosen) and, with
            the last token, the request's metrics. None (default): nothing is recorded.

    The last yielded step carries the ``finish_reason``. For batched decoding call
    :func:`prefill` and :func:`decode_step` directly.

    Raises ValueError (empty prompt), CacheFullError (the prompt does not fit).
    """
    params = params or SamplingParams()
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if len(prompt_ids) > model.config.max_seq_len:
        raise CacheFullError(
            f"the prompt is {len(prompt_ids)} tokens but the model's context is {model.config.max_seq_len} "
            "(prompt and output together); shorten the prompt"
        )
    if cache is None:
        max_seq_len = min(model.config.max_seq_len, len(prompt_ids) + params.max_new_tokens)
        cache = KVCache.for_model(model, max_seq_len=max(max_seq_len, 1))
    eos = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    generator = params.make_generator(cache.k.device)

    request = prefix_cache.begin(model, prompt_ids, cache, trace=trace) if prefix_cache is not None else None
    cached = request.cached_tokens if request else 0
    try:
        logits = prefill(model, prompt_ids[cached:], cache, trace=trace)  # with a prefix cache hit: only the suffix
        if request:
            prefix_cache.commit(model, request, cache, trace=trace)
        phase = "prefill"
        for n in range(1, params.max_new_tokens + 1):
            token, logprob = sample(logits, params, generator)
            token_id = token.item()  # waits for the device: the token is now really known
            now = time.perf_counter()
            reason = _finish_reason(token_id, n, eos, params, cache)
            if trace is not None:
                trace.record_sample(logits, token_id, params, now, reason)
                if reason:
                    trace.record_metrics(len(prompt_ids), reason)
            yield GenerationStep(token_id, logprob.item(), phase, cache.length, now, reason,
                                 cached_tokens=cached, prefill_tokens=len(prompt_ids) - cached)
            if reason:
                return
            logits = decode_step(model, token, cache, trace=trace)
            phase = "decode"
    finally:  # also when the caller stops iterating early (generator close)
        if request:
            prefix_cache.end(request)


def _finish_reason(token_id: int, n_generated: int, eos: set, params: SamplingParams, cache: KVCache):
    if token_id in eos:
        return "eos"
    if token_id in params.stop_token_ids:
        return "stop"
    if n_generated >= params.max_new_tokens:
        return "length"
    if cache.length >= cache.max_seq_len:
        return "cache_full"  # no room to decode this token
    return None
