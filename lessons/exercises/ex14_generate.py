"""Exercise 14: the generate loop, assembled from the pieces of exercises 5 to 8.

Write ``generate``: prefill the prompt once, then repeat { sample a token from the logits,
decide whether to stop, yield a GenerationStep, decode_step that token } until a stop.
It is a Python generator (``yield``), as minillm's is, so a caller can print each token
as it comes. Use minillm's ``prefill``, ``decode_step`` and ``sample`` (imported below;
yours from exercises 6 to 8 do the same) and ``params.make_generator(...)`` for the seed.
A small ``finish_reason(...)`` helper of your own keeps the loop short.

The signature and docstring are minillm's own ``generate``. The checks pass the first five
arguments (``prompt_ids`` [T] int64, ``params``, a ``cache``, ``eos_token_ids`` as a set) and
leave ``prefix_cache``, ``trace``, ``tokenizer`` and ``speculative`` at None; their ``params``
hold only what ``sample`` reads and the token stops (no stop strings, penalties, logit_bias or
allowed_tokens). Write the loop for those: minillm adds the rest as small helpers around it.

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

from minillm.errors import CacheFullError  # noqa: F401
from minillm.generate import GenerationStep
from minillm.kv_cache import KVCache
from minillm.model import Transformer
from minillm.phases import decode_step, prefill  # noqa: F401
from minillm.prefix_cache import PrefixCache
from minillm.sampling import SamplingParams, sample  # noqa: F401
from minillm.speculative import SpeculativeConfig


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
    raise NotImplementedError(
        "Exercise 14 (the generate loop) is not written yet: "
        "see lessons/02-prefill-and-decode.md#the-two-phases-at-a-glance"
    )
