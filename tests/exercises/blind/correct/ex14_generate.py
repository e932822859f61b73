"""Exercise 14: the generate loop, assembled from the pieces of exercises 5 to 8.

Write ``generate``: prefill the prompt once, then repeat { sample a token from the logits,
decide whether to stop, yield a GenerationStep, decode_step that token } until a stop.
It is a Python generator (``yield``), as minillm's is, so a caller can print each token
as it comes. Use minillm's ``prefill``, ``decode_step`` and ``sample`` (imported below;
yours from exercises 6 to 8 do the same) and ``params.make_generator(...)`` for the seed.
A small ``finish_reason(...)`` helper of your own keeps the loop short.

The checks run your loop and minillm's ``generate`` on a tiny random model and compare
every step: tokens, logprobs, phases, cache lengths, finish reasons.

Check:      minillm check ex14   (or: pytest tests/exercises -m ex14 --impl student)
Lesson:     lessons/02-prefill-and-decode.md#the-two-phases-at-a-glance, lessons/04-decode-slowly.md
Reference:  minillm/generate.py: ``generate``, the loop, then its helpers (the prefix cache, constrained
            decoding, the trace, speculative decoding). Peek once your checks pass, or when stuck.
"""

from __future__ import annotations

import time  # noqa: F401
from typing import Iterator

import torch

from minillm.errors import CacheFullError  # noqa: F401
from minillm.generate import GenerationStep
from minillm.kv_cache import KVCache
from minillm.model import Transformer
from minillm.phases import decode_step, prefill  # noqa: F401
from minillm.sampling import SamplingParams, sample  # noqa: F401


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
    ids = torch.as_tensor(prompt_ids).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("empty prompt")
    device = model.embed.weight.device
    ids = ids.to(device=device, dtype=torch.long)
    generator = params.make_generator(device)
    T = ids.numel()
    logits = prefill(model, ids.unsqueeze(0), cache)
    phase = "prefill"
    out: list[int] = []
    while True:
        tok, lp = sample(logits, params, generator, prompt_ids=ids.unsqueeze(0),
                         output_ids=torch.tensor([out], dtype=torch.long, device=device))
        t = time.perf_counter()
        token = int(tok[0])
        out.append(token)
        reason, stop_reason = None, None
        if token in eos_token_ids and not params.ignore_eos:
            reason = "eos"
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif len(out) >= params.max_new_tokens:
            reason = "length"
        elif cache.length + 1 > cache.max_seq_len:
            reason = "cache_full"
        yield GenerationStep(token_id=token, logprob=float(lp[0]), phase=phase, cache_length=cache.length,
                             time_s=t, finish_reason=reason, prefill_tokens=T, stop_reason=stop_reason)
        if reason is not None:
            return
        logits = decode_step(model, tok.reshape(1), cache)
        phase = "decode"
