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

from .kv_cache import KVCache
from .model import Transformer
from .phases import decode_step, prefill
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
    """

    token_id: int
    logprob: float
    phase: str
    cache_length: int
    time_s: float
    finish_reason: str | None = None


def generate(
    model: Transformer,
    prompt_ids,
    params: SamplingParams | None = None,
    cache: KVCache | None = None,
    eos_token_ids=None,
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

    The last yielded step carries the ``finish_reason``. For batched decoding call
    :func:`prefill` and :func:`decode_step` directly.

    Raises ValueError (empty prompt), CacheFullError (the prompt does not fit).
    """
    params = params or SamplingParams()
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if cache is None:
        max_seq_len = min(model.config.max_seq_len, len(prompt_ids) + params.max_new_tokens)
        cache = KVCache.for_model(model, max_seq_len=max(max_seq_len, 1))
    eos = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    generator = params.make_generator(cache.k.device)

    logits = prefill(model, prompt_ids, cache)
    phase = "prefill"
    for n in range(1, params.max_new_tokens + 1):
        token, logprob = sample(logits, params, generator)
        token_id = token.item()  # waits for the device: the token is now really known
        now = time.perf_counter()
        reason = _finish_reason(token_id, n, eos, params, cache)
        yield GenerationStep(token_id, logprob.item(), phase, cache.length, now, reason)
        if reason:
            return
        logits = decode_step(model, token, cache)
        phase = "decode"


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
