"""Reference solutions of exercises whose function minillm does not have at that size.

Exercise 14 asks for the generate loop alone. minillm's own ``minillm.generate.generate``
also handles a prefix cache, a trace, a tokenizer with stop strings and penalties, too
much for one sitting; the reference below is that loop without them, and the checks
compare both (on a tiny model) token by token.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from minillm.generate import GenerationStep
from minillm.kv_cache import KVCache
from minillm.model import Transformer
from minillm.phases import decode_step, prefill
from minillm.sampling import SamplingParams, sample


def generate(
    model: Transformer,
    prompt_ids: torch.Tensor,
    params: SamplingParams,
    cache: KVCache,
    eos_token_ids: set[int],
) -> Iterator[GenerationStep]:
    """Generate tokens for one prompt: prefill once, then sample and decode_step until a stop.

    Args:
        model: the transformer.
        prompt_ids: the prompt, [T] int64, T >= 1.
        params: sampling (temperature, top_k, top_p, seed) and stopping (max_new_tokens,
            stop_token_ids).
        cache: a batch-1 KV cache with room for the prompt; it may already hold a prefix
            (the prompt then continues after it).
        eos_token_ids: ids that end generation.

    Yields one :class:`~minillm.generate.GenerationStep` per token, with token_id, logprob,
    phase ("prefill" for the first token, "decode" after), cache_length (``cache.length``
    after the forward pass that produced the token), time_s (``time.perf_counter()``),
    finish_reason and prefill_tokens (T). The finish reason is None until the last step,
    which has the first that applies of: "eos" (the token is an EOS id), "stop" (one of
    params.stop_token_ids), "length" (max_new_tokens tokens generated), "cache_full" (no
    room left to decode the token). The last token is not decoded: nothing would use its logits.

    Raises ValueError (empty prompt), CacheFullError (the prompt does not fit in the cache).
    """
    generator = params.make_generator(cache.k.device)
    logits = prefill(model, prompt_ids, cache)
    phase = "prefill"
    for n in range(1, params.max_new_tokens + 1):
        token, logprob = sample(logits, params, generator)
        token_id = token.item()
        reason = finish_reason(token_id, n, eos_token_ids, params, cache)
        yield GenerationStep(token_id, logprob.item(), phase, cache.length, time.perf_counter(), reason,
                             prefill_tokens=len(prompt_ids))
        if reason:
            return
        logits = decode_step(model, token, cache)
        phase = "decode"


def finish_reason(token_id: int, n_generated: int, eos_token_ids: set[int], params: SamplingParams,
                  cache: KVCache) -> str | None:
    """Why generation ends after ``token_id`` (the n_generated-th token), or None to go on."""
    if token_id in eos_token_ids:
        return "eos"
    if token_id in params.stop_token_ids:
        return "stop"
    if n_generated >= params.max_new_tokens:
        return "length"
    if cache.length >= cache.max_seq_len:
        return "cache_full"
    return None
