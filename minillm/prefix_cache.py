"""The prefix cache: K/V of prompt prefixes seen before, so their prefill is skipped.

Requests that start with the same tokens (a system prompt, a pasted document, earlier
chat turns) have the same K/V for those tokens. The prefix cache keeps it in blocks of
``block_size`` tokens, named by chained hashes (:mod:`minillm.block_hash`), so shared
prefixes are stored once and form a tree::

    prompt A: [ sys0 | sys1 | sys2 | qA.. ]          a block = block_size tokens
    prompt B: [ sys0 | sys1 | sys2 | qB.. ]          (".." = a partial block: not cached)

    seed ──> h0 ──> h1 ──> h2 ──┬──> h3(A)           each block stores its K and V
             sys0   sys1   sys2  └──> h3(B)           for every layer, its token ids,
                                                      and its parent's hash

    lookup(B): h0 hit, h1 hit, h2 hit, h3(B) miss  ->  cached_tokens = 3·block_size:
    copy those K/V into the request's KVCache, prefill only positions 3·block_size.. .

This is vLLM's automatic prefix caching, in small. The rules:

- Only full blocks are cached; a partially matching block is never used.
- Lookup walks from the first block and stops at the first miss (h_i covers all parents).
- A hit also compares the stored token ids and parent with the prompt's, so a hash
  collision can never serve wrong K/V.
- At least one prompt token is always prefilled: its logits give the first output
  token. A prompt of exactly N·block_size tokens hits at most (N-1)·block_size.
- When full (``capacity_blocks`` / ``capacity_bytes``), the least recently used *leaf*
  is evicted: children go before parents, so every cached block's parent is cached.
- A request locks (ref counts) its blocks while it runs; locked blocks are never evicted.

When blocks are inserted: the prompt's full blocks, right after its prefill. Blocks that
fill during decode are not inserted (a follow-up chat turn re-sends the answer in its
prompt, and that prompt's blocks are inserted after its own prefill).

The small interface is ``match`` / ``insert`` / ``evict`` / ``lock`` / ``unlock`` (plus
``load``: copy K/V into a KVCache). ``begin`` / ``commit`` / ``end`` strings them
together for one request; :func:`minillm.generate` calls those.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Container, Sequence

import torch

from .block_hash import HashFn, block_hashes, hash_block, model_seed, short
from .kv_cache import KVCache
from .units import fmt_bytes


@dataclass
class CachedBlock:
    """One cached block: K/V of ``block_size`` positions for every layer.

    Attributes:
        hash: this block's chained hash (its key in the cache).
        parent: the previous block's hash, None for a prompt's first block.
        index: position in the chain; it holds positions index·B .. index·B + B - 1.
        token_ids: the block's tokens (compared on every hit).
        k, v: [n_layers, n_kv_heads, block_size, head_dim].
        last_used: logical clock of the last lookup or insert that touched it (for LRU).
        ref_count: running requests holding it; > 0 means it cannot be evicted.
        n_children: cached blocks whose parent it is; > 0 means it cannot be evicted.
    """

    hash: bytes
    parent: bytes | None
    index: int
    token_ids: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor
    last_used: int = 0
    ref_count: int = 0
    n_children: int = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass(frozen=True)
class PrefixMatch:
    """The result of one lookup.

    Attributes:
        block_hashes: hashes of every full block of the prompt, root first.
        n_hit_blocks: how many of them, from the first, are served from the cache.
        block_size, n_tokens: the block size and the prompt length (tokens).
        stop: why the walk stopped: "miss" (not cached), "collision" (same hash, other
            tokens or parent), "cap" (the last token must be prefilled) or "end" (no
            more full blocks).
    """

    block_hashes: tuple[bytes, ...]
    n_hit_blocks: int
    block_size: int
    n_tokens: int
    stop: str

    @property
    def hit_hashes(self) -> tuple[bytes, ...]:
        return self.block_hashes[: self.n_hit_blocks]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose K/V comes from the cache (a multiple of block_size)."""
        return self.n_hit_blocks * self.block_size

    @property
    def first_miss(self) -> int | None:
        """Index of the first full block not served from the cache, None if all were."""
        return self.n_hit_blocks if self.n_hit_blocks < len(self.block_hashes) else None


@dataclass
class PrefixRequest:
    """One request's use of the cache, from :meth:`PrefixCache.begin` to :meth:`PrefixCache.end`.

    Attributes:
        token_ids: the prompt.
        match: its lookup.
        extra_keys: hashed into every block (see :func:`minillm.block_hash.hash_block`).
        locked: block hashes this request holds a lock on (released by ``end``).
    """

    token_ids: tuple[int, ...]
    match: PrefixMatch
    extra_keys: tuple = ()
    locked: list[bytes] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (what providers bill as cached input)."""
        return self.match.cached_tokens

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the prefill computes: the prompt minus the cached prefix (>= 1)."""
        return len(self.token_ids) - self.cached_tokens


@dataclass(frozen=True)
class PrefixCacheStats:
    """Whole-cache counters since creation or the last ``reset()``.

    Attributes:
        requests: lookups made.
        query_tokens: prompt tokens looked up.
        hit_tokens: of those, served from the cache (always a multiple of block_size).
        blocks, bytes: stored now (K and V of all layers).
        inserted_blocks, evictions: blocks stored and evicted so far.
    """

    requests: int
    query_tokens: int
    hit_tokens: int
    blocks: int
    bytes: int
    inserted_blocks: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens (0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


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
    max_blocks = max(n_tokens - 1, 0) // block_size
    n_hit = 0
    for h in block_hashes[:max_blocks]:
        if h not in cached:
            break
        n_hit += 1
    return n_hit * block_size


class PrefixCache:
    """Automatic prefix cache: block hash -> that block's K/V, evicted LRU leaf first.

    Args:
        model: the model whose K/V is stored (sizes for display; lookups take the
            requesting model, and another model or dtype gets its own hashes).
        block_size: tokens per block (vLLM's default is 16).
        capacity_blocks, capacity_bytes: limits, None for unbounded; both may be set.
        hash_fn: ``hash_fn(parent, token_ids, extra_keys) -> bytes``; a test hook to
            force collisions, leave the default otherwise.

    Raises ValueError for block_size < 1 or a negative capacity.
    """

    def __init__(self, model, block_size: int = 16, capacity_blocks: int | None = None,
                 capacity_bytes: int | None = None, hash_fn: HashFn = hash_block):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        for name, value in (("capacity_blocks", capacity_blocks), ("capacity_bytes", capacity_bytes)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None (unbounded), got {value}")
        self.model = model
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.capacity_bytes = capacity_bytes
        self.hash_fn = hash_fn
        self.reset()

    def reset(self) -> None:
        """Drop every block and zero the stats."""
        self._blocks: dict[bytes, CachedBlock] = {}
        self._clock = 0
        self._bytes = 0
        self._counts = dict(requests=0, query_tokens=0, hit_tokens=0, inserted_blocks=0, evictions=0)

    # -- the small interface: match / insert / evict / lock ---------------------------------

    def match(self, model, token_ids: Sequence[int], extra_keys: tuple = (), trace=None) -> PrefixMatch:
        """Look up the longest cached prefix of ``token_ids`` (full blocks, capped at len - 1 tokens).

        Touches the hit blocks (LRU) and counts the request in the stats.
        """
        ids = _as_ints(token_ids)
        B = self.block_size
        hashes = block_hashes(ids, B, model_seed(model), extra_keys, self.hash_fn)
        max_hit = max(len(ids) - 1, 0) // B  # leave at least one token to prefill
        self._clock += 1
        n_hit, stop, parent = 0, "end", None
        for i, h in enumerate(hashes):
            if i == max_hit:
                stop = "cap"
                break
            block = self._blocks.get(h)
            if block is None:
                stop = "miss"
                break
            if block.parent != parent or block.token_ids != tuple(ids[i * B : (i + 1) * B]):
                stop = "collision"
                break
            block.last_used = self._clock
            n_hit, parent = n_hit + 1, h
        m = PrefixMatch(tuple(hashes), n_hit, B, len(ids), stop)
        self._counts["requests"] += 1
        self._counts["query_tokens"] += len(ids)
        self._counts["hit_tokens"] += m.cached_tokens
        if trace is not None:
            trace.record("prefix_lookup", n_tokens=len(ids), full_blocks=len(hashes), blocks_matched=n_hit,
                         first_miss=m.first_miss, stop=stop, cached_tokens=m.cached_tokens,
                         prefill_tokens=len(ids) - m.cached_tokens)
            if n_hit:
                trace.record("prefix_hit", blocks=[short(h) for h in m.hit_hashes], positions=(0, m.cached_tokens))
        return m

    def insert(self, model, token_ids: Sequence[int], cache: KVCache, extra_keys: tuple = (),
               trace=None) -> list[bytes]:
        """Store the full blocks of ``token_ids`` whose K/V is in ``cache`` (positions < cache.length).

        Blocks already cached are touched, new ones copied out of the cache (batch row 0).
        Stops early on a collision or when no block can be evicted to make room.
        Returns the hashes of this prompt's blocks that are now cached, root first.
        """
        _check_not_rolling(cache)
        ids = _as_ints(token_ids)[: cache.length]
        B = self.block_size
        hashes = block_hashes(ids, B, model_seed(model), extra_keys, self.hash_fn)
        self._clock += 1
        chain, new, parent, stop = [], [], None, "end"
        for i, h in enumerate(hashes):
            tokens = tuple(ids[i * B : (i + 1) * B])
            block = self._blocks.get(h)
            if block is not None and (block.parent != parent or block.token_ids != tokens):
                stop = "collision"
                break
            if block is None:
                k, v = cache.k[:, 0, :, i * B : (i + 1) * B], cache.v[:, 0, :, i * B : (i + 1) * B]
                if not self._make_room(2 * k.numel() * k.element_size(), keep=parent, trace=trace):
                    stop = "full"
                    break
                block = CachedBlock(h, parent, i, tokens, k.clone(), v.clone())
                self._store(block)
                new.append(h)
            block.last_used = self._clock
            chain.append(h)
            parent = h
        if trace is not None:
            first = len(chain) - len(new)
            trace.record("prefix_insert", blocks=[short(h) for h in new], positions=(first * B, len(chain) * B),
                         already_cached=first, stop=stop, cache_blocks=len(self._blocks))
        return chain

    def evict(self, n_blocks: int = 1, trace=None) -> list[bytes]:
        """Evict up to ``n_blocks`` least recently used unlocked leaves; returns their hashes."""
        evicted = []
        for _ in range(n_blocks):
            victim = self._lru_leaf(keep=None)
            if victim is None:
                break
            self._evict_block(victim, trace)
            evicted.append(victim.hash)
        return evicted

    def lock(self, hashes: Sequence[bytes]) -> None:
        """Take one reference on each block: it cannot be evicted until unlocked."""
        for h in hashes:
            self._blocks[h].ref_count += 1

    def unlock(self, hashes: Sequence[bytes]) -> None:
        """Drop one reference on each block (blocks gone since a ``reset()`` are skipped)."""
        for h in hashes:
            block = self._blocks.get(h)
            if block is not None:
                if block.ref_count == 0:
                    raise ValueError(f"unlock of block {short(h)}, which is not locked")
                block.ref_count -= 1

    def load(self, hashes: Sequence[bytes], cache: KVCache) -> None:
        """Copy the blocks' K/V into an empty batch-1 ``cache`` at positions 0.. and advance its length."""
        if cache.length != 0 or cache.batch_size != 1:
            raise ValueError(f"load needs an empty batch-1 KVCache, got length {cache.length}, "
                             f"batch {cache.batch_size}")
        _check_not_rolling(cache)
        B = self.block_size
        cache.check_room(len(hashes) * B)
        for i, h in enumerate(hashes):
            block = self._blocks[h]
            cache.k[:, 0, :, i * B : (i + 1) * B] = block.k
            cache.v[:, 0, :, i * B : (i + 1) * B] = block.v
        cache.advance(len(hashes) * B)

    # -- one request: begin (match, lock, load) / commit (insert) / end (unlock) ------------

    def begin(self, model, prompt_ids, cache: KVCache, extra_keys: tuple = (), trace=None) -> PrefixRequest:
        """Look up the prompt, lock its hit blocks and copy their K/V into the empty ``cache``.

        Afterwards ``cache.length == request.cached_tokens``: prefill ``prompt_ids[cached_tokens:]``.
        Raises ValueError if ``cache`` is not empty, not batch 1, or not shaped for ``model``.
        """
        cache.check_matches(model)  # before any copy: a cache for another model fails inside torch
        if cache.length != 0 or cache.batch_size != 1:
            raise ValueError("the prefix cache fills a KV cache from position 0: pass an empty batch-1 "
                             f"KVCache (got length {cache.length}, batch {cache.batch_size})")
        ids = tuple(_as_ints(prompt_ids))
        m = self.match(model, ids, extra_keys, trace)
        self.lock(m.hit_hashes)
        self.load(m.hit_hashes, cache)
        return PrefixRequest(ids, m, tuple(extra_keys), list(m.hit_hashes))

    def commit(self, model, request: PrefixRequest, cache: KVCache, trace=None) -> None:
        """After the prefill: insert the prompt's full blocks; the request locks the new ones too."""
        chain = self.insert(model, request.token_ids, cache, request.extra_keys, trace)
        new = [h for h in chain if h not in request.locked]
        self.lock(new)
        request.locked.extend(new)

    def end(self, request: PrefixRequest) -> None:
        """Release the request's locks (idempotent)."""
        self.unlock(request.locked)
        request.locked = []

    # -- eviction internals --------------------------------------------------------------------

    def _store(self, block: CachedBlock) -> None:
        self._blocks[block.hash] = block
        self._bytes += block.nbytes
        self._counts["inserted_blocks"] += 1
        if block.parent is not None:
            self._blocks[block.parent].n_children += 1

    def _make_room(self, nbytes: int, keep: bytes | None, trace) -> bool:
        """Evict LRU leaves until a block of ``nbytes`` fits; False if it cannot."""
        while self._over_capacity(nbytes):
            victim = self._lru_leaf(keep)
            if victim is None:
                return False
            self._evict_block(victim, trace)
        return True

    def _over_capacity(self, nbytes: int) -> bool:
        too_many = self.capacity_blocks is not None and len(self._blocks) + 1 > self.capacity_blocks
        too_big = self.capacity_bytes is not None and self._bytes + nbytes > self.capacity_bytes
        return too_many or too_big

    def _lru_leaf(self, keep: bytes | None) -> CachedBlock | None:
        """The least recently used block with no children and no lock (``keep`` excluded)."""
        candidates = [b for b in self._blocks.values() if b.n_children == 0 and b.ref_count == 0 and b.hash != keep]
        return min(candidates, key=lambda b: b.last_used, default=None)

    def _evict_block(self, block: CachedBlock, trace) -> None:
        del self._blocks[block.hash]
        self._bytes -= block.nbytes
        self._counts["evictions"] += 1
        if block.parent is not None:
            self._blocks[block.parent].n_children -= 1
        if trace is not None:
            trace.record("prefix_evict", block=short(block.hash), parent=short(block.parent), index=block.index,
                         last_used=block.last_used, cache_blocks=len(self._blocks))

    # -- state ----------------------------------------------------------------------------------

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(blocks=len(self._blocks), bytes=self._bytes, **self._counts)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block for ``model``: block_size · 2 · n_layers · n_kv_heads · head_dim · dtype bytes."""
        return self.block_size * self.model.config.kv_bytes_per_token(next(self.model.parameters()).element_size())

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def block(self, block_hash: bytes) -> CachedBlock:
        """The cached block under ``block_hash`` (KeyError if absent)."""
        return self._blocks[block_hash]

    def blocks(self) -> list[dict]:
        """One row per cached block, in chain order (index), then by last use: short hashes and counters."""
        rows = sorted(self._blocks.values(), key=lambda b: (b.index, b.last_used))
        return [dict(block=short(b.hash), parent=short(b.parent), index=b.index,
                     positions=(b.index * self.block_size, (b.index + 1) * self.block_size),
                     tokens=b.token_ids, last_used=b.last_used, ref_count=b.ref_count,
                     children=b.n_children, bytes=b.nbytes) for b in rows]

    def __repr__(self) -> str:
        s = self.stats
        cap = [f"{self.capacity_blocks} blocks" if self.capacity_blocks is not None else "",
               fmt_bytes(self.capacity_bytes) if self.capacity_bytes is not None else ""]
        cap = " / ".join(c for c in cap if c) or "unbounded"
        return (f"PrefixCache(block_size={self.block_size}, blocks={s.blocks}, bytes={fmt_bytes(s.bytes)}, "
                f"capacity={cap}, requests={s.requests}, hit_tokens={s.hit_tokens}/{s.query_tokens} "
                f"({100 * s.hit_rate:.1f}%), evictions={s.evictions})")

    def _repr_html_(self, max_rows: int = 64) -> str:
        rows = self.blocks()
        head = "".join(f"<th>{c}</th>" for c in ("block", "parent", "index", "positions", "tokens", "last_used",
                                                  "ref_count", "children"))
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
                r["block"], r["parent"], r["index"], f"{r['positions'][0]}..{r['positions'][1] - 1}",
                _preview(r["tokens"]), r["last_used"], r["ref_count"], r["children"])) + "</tr>"
            for r in rows[:max_rows])
        more = f"<p>... and {len(rows) - max_rows} more blocks</p>" if len(rows) > max_rows else ""
        return f"<b>{html.escape(repr(self))}</b><table><tr>{head}</tr>{body}</table>{more}"


def _as_ints(token_ids) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.reshape(-1).tolist()
    return [int(t) for t in token_ids]


def _preview(tokens: tuple[int, ...], n: int = 6) -> str:
    return " ".join(map(str, tokens[:n])) + (" ..." if len(tokens) > n else "")


def _check_not_rolling(cache: KVCache) -> None:
    """Blocks are copied by position; a rolling buffer (sliding-window layers) keeps slots, not positions."""
    if cache.rolling_layers:
        raise ValueError("the prefix cache copies K/V by position, and this KVCache's sliding-window layers are "
                         "rolling buffers; build it with KVCache.for_model(model, rolling=False)")
