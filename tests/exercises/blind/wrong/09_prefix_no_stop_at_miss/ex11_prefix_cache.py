"""Exercise 11: prefix-cache block hashes and the longest cached prefix.

Write ``block_hashes`` (the chained hash of every full block; call ``hash_fn(parent,
block_tokens, extra_keys)``, which defaults to minillm's sha256 ``hash_block``) and
``longest_cached_prefix`` (how many prompt tokens the cache can serve). Try them on a real
cache: ``longest_cached_prefix(block_hashes(ids, 16, model_seed(model)), prefix_cache,
len(ids), 16)``.

Check:      minillm check ex11   (or: pytest tests/exercises -m ex11 --impl student)
Lesson:     lessons/08-prompt-caching.md#block-hashes
Reference:  minillm.block_hash.block_hashes,
            minillm.prefix_cache.longest_cached_prefix
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

from typing import Container, Sequence

from minillm.block_hash import HashFn, hash_block


def block_hashes(
    token_ids: Sequence[int], block_size: int, seed: bytes, extra_keys: tuple = (), hash_fn: HashFn = hash_block
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids``, root first (a partial last block has none)."""
    hashes = []
    parent = seed
    n_full = len(token_ids) // block_size
    for i in range(n_full):
        block = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_fn(parent, block, extra_keys)
        hashes.append(parent)
    return hashes


def longest_cached_prefix(block_hashes: Sequence[bytes], cached: Container[bytes], n_tokens: int,
                          block_size: int) -> int:
    """Prompt tokens whose K/V the prefix cache can serve (``cached_tokens``), a multiple of block_size.

    Args:
        block_hashes: the prompt's full-block hashes, root first (:func:`~minillm.block_hash.block_hashes`).
        cached: the hashes in the cache: a set, or a :class:`PrefixCache` itself.
        n_tokens: the prompt length (tokens); block_size: tokens per block.

    The rule :meth:`PrefixCache.match` applies (match also compares the stored tokens, against
    collisions): walk from the first block and stop at the first miss, since h_i stands for
    every token before it too; a partial last block has no hash and never counts; and at least
    one token is left to prefill (its logits give the first output token), so at most
    (n_tokens - 1) // block_size blocks::

        n_tokens = 8, block_size = 4, both blocks cached  ->  4 (token 7 must be prefilled)
        n_tokens = 9, block_size = 4, both blocks cached  ->  8
    """
    max_blocks = (n_tokens - 1) // block_size if n_tokens > 0 else 0
    hit = 0
    for h in list(block_hashes)[:max_blocks]:
        if h in cached:
            hit += 1
    return hit * block_size
