"""The two phases of LLM inference, as plain functions.

**prefill**: the whole prompt in one parallel forward pass. Every prompt token's K/V
goes into the cache at once; only the last position's logits are needed, they give
the first output token. Many tokens per weight read: limited by arithmetic (TTFT).

**decode**: one token per forward pass. The new token attends over the whole cache
and appends one K/V entry per layer. Every step re-reads all weights and the cache
for a single token: limited by memory bandwidth (TPOT).

    prompt  [t0 t1 t2 t3]   --prefill-->  cache length 4, logits for position 4
    token   [t4]            --decode--->  cache length 5, logits for position 5
    token   [t5]            --decode--->  cache length 6, ...
"""

from __future__ import annotations

import torch

from .kv_cache import KVCache
from .model import Hook, Transformer
from .trace import Trace


def prefill(model: Transformer, token_ids, cache: KVCache, hook: Hook | None = None, trace=None) -> torch.Tensor:
    """Process a prompt in one forward pass, filling the KV cache.

    Args:
        model: the transformer.
        token_ids: [T] or [B, T] int64 (a list of ints is accepted). Positions start at
            ``cache.length``, so a suffix can be prefilled onto an already filled cache
            (this is how the prefix cache skips a cached prefix).
        cache: the KV cache; its length grows by T.
        hook: optional ``hook(name, tensor)`` observer of per-layer activations.
        trace: optional :class:`~minillm.trace.Trace`; records a "prefill" event (time,
            FLOPs, bytes, K/V written). None: nothing is timed.

    Returns float32 logits of the last position, [B, vocab].

    Raises ValueError (empty prompt, wrong rank or batch, ids out of vocab range, a cache
    or trace that does not fit), CacheFullError (the prompt does not fit in the cache).
    """
    _check_state(model, cache, trace)
    token_ids = _as_batch(model, token_ids, cache, what="token_ids")
    cache.check_room(token_ids.shape[1])
    with torch.inference_mode():
        if trace is None:
            logits = model(token_ids, cache=cache, hook=hook, last_only=True)
        else:
            logits = trace.forward("prefill", model, token_ids, cache, hook, last_only=True)
    return logits[:, -1].float()


def decode_step(model: Transformer, token_id, cache: KVCache, hook: Hook | None = None, trace=None) -> torch.Tensor:
    """Generate the next logits from one new token per sequence.

    Args:
        token_id: the token just produced, a scalar / int (batch 1) or [B] int64.
        cache: the KV cache holding everything before it; this token's K/V is
            appended at position ``cache.length`` (length grows by 1).
        hook: optional ``hook(name, tensor)`` observer of per-layer activations.
        trace: optional :class:`~minillm.trace.Trace`; records a "decode" event.

    Returns float32 logits for the following position, [B, vocab].

    The speed layer may give the model its own step (``model.compiled_decode``: the "compile" paths'
    graph, the "replay" path's C calls, :mod:`minillm.fast.choose`): a step without hook, or with a
    trace at level "steps", then runs it instead, where it says it applies: the same logits.

    Raises ValueError (bad shape or id, several tokens for one sequence, a cache or trace
    that does not fit), CacheFullError (no room for one more token).
    """
    _check_state(model, cache, trace)
    token_ids = _as_batch(model, token_id, cache, what="token_id").reshape(-1, 1)
    cache.check_room(1)
    compiled = getattr(model, "compiled_decode", None)  # the hook for minillm/fast: skip on a first reading
    if compiled is not None and (hook is not None or not compiled.applies(model, cache)):
        compiled = None
    if compiled is not None and hook is None and trace is None:
        return compiled(model, token_ids, cache)  # (a hook, or a trace of the layers, needs the eager step)
    with torch.inference_mode():
        if trace is None:
            logits = model(token_ids, cache=cache, hook=hook)
        else:
            logits = trace.forward("decode", model, token_ids, cache, hook, compiled=compiled)
    return logits[:, -1].float()


def _check_state(model: Transformer, cache: KVCache, trace) -> None:
    """The cache and the trace a pass is given: the right kinds, and a cache shaped for this model."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache, got {type(cache).__name__}; "
                         "build one with KVCache.for_model(model, max_seq_len=...)")
    cache.check_matches(model)
    if trace is not None and not isinstance(trace, Trace):
        raise ValueError(f"trace must be a minillm Trace or None, got {type(trace).__name__}")


def _as_batch(model: Transformer, ids, cache: KVCache, what: str) -> torch.Tensor:
    """ids as a [B, T] int64 tensor on the model's device; T may be absent for decode."""
    device = cache.k.device
    if isinstance(ids, str):
        raise ValueError(f"{what} must be token ids, got a str; encode text with the tokenizer first")
    try:
        ids = ids.to(device) if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=device)
    except (TypeError, ValueError, RuntimeError) as e:  # ragged lists, None, objects
        raise ValueError(f"{what} must be an int, a list of ints or an int tensor ({e})") from None
    if ids.numel() == 0:
        raise ValueError(f"{what} is empty; give at least one token")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what} must hold integer token ids, got dtype {ids.dtype}")
    max_rank = 2 if what == "token_ids" else 1
    if ids.dim() > max_rank:
        raise ValueError(f"{what} must have at most {max_rank} dimensions, got shape {tuple(ids.shape)}"
                         + (_ONE_TOKEN_HINT if what == "token_id" else ""))
    if what == "token_ids" and ids.dim() < 2:
        ids = ids.reshape(1, -1)
    batch = ids.shape[0] if ids.dim() else 1
    if batch != cache.batch_size:
        hint = _ONE_TOKEN_HINT if what == "token_id" and cache.batch_size == 1 else ""
        raise ValueError(f"{what} has batch {batch} but the KV cache was built for batch {cache.batch_size}{hint}")
    vocab = model.config.vocab_size
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"{what} must be in [0, {vocab}) (the vocabulary), got {ids.min().item()}..{ids.max().item()}")
    return ids.long()


_ONE_TOKEN_HINT = ("; decode_step takes one token per sequence (to process several tokens in one pass, "
                   "call prefill: it continues from cache.length)")


def verify(model: Transformer, token_ids, cache: KVCache) -> torch.Tensor:
    """Score k guessed tokens in one pass: speculative decoding's verification (minillm/speculative.py).

    A draft guessed d1..dk to follow the last token. Verify runs [last d1 .. dk] onto the filled
    cache as a short prefill does, but keeps every position's logits, not only the last: row i is
    the model's next-token logits after token i. So one pass (one read of the weights, about a
    decode step's cost) checks all k guesses and gives the token after the last one kept.

        cache [t0 t1 t2 t3] + [t4 d1 d2 d3]  --verify-->  logits after t4, d1, d2, d3 (k+1 = 4 rows)
                                                           cache length 8; the caller truncates
                                                           it after the last accepted draft

    Args:
        model: the transformer.
        token_ids: [k+1] int64 (or a list of ints): the last token, then the k drafts; batch 1.
        cache: the batch-1 KV cache holding everything before them; its length grows by k+1
            (``cache.truncate`` then takes the rejected drafts back out).

    Returns float32 logits [k+1, vocab].

    With nothing drafted (k = 0) the pass is :func:`decode_step`, so a decode path with a
    compiled step (:mod:`minillm.fast.choose`) runs it: free-form text has many such rounds.

    Raises ValueError (as :func:`prefill`: empty ids, ids out of vocab range, a cache for another
    batch or model), CacheFullError (no room for k+1 tokens).
    """
    if len(token_ids) == 1:
        return decode_step(model, token_ids[0], cache)
    _check_state(model, cache, None)
    ids = _as_batch(model, token_ids, cache, what="token_ids")
    cache.check_room(ids.shape[1])
    with torch.inference_mode():
        return model(ids, cache=cache)[0].float()  # all k+1 rows: [1, k+1, vocab] -> [k+1, vocab]
