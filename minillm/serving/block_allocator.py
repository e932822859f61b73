"""The block allocator: which fixed-size blocks of the KV pool each request owns.

A paged KV cache (vLLM's PagedAttention, Kwon et al. 2023) does not give a request one
contiguous [max_seq_len] slab. It hands out blocks of ``block_size`` positions on demand,
and a per-request *block table* says which physical block holds which logical block::

    request A, 37 tokens, block_size 16:   block table [7, 2, 9]
        logical block  0 -> physical 7   positions  0..15
        logical block  1 -> physical 2   positions 16..31
        logical block  2 -> physical 9   positions 32..36  (+ 11 free slots: the only waste)

Blocks are shared by reference, not copied. A full block is named by the chained hash of
every token up to its end (:mod:`minillm.block_hash`, the same names as
:class:`~minillm.prefix_cache.PrefixCache`). A new request whose prompt starts with
cached blocks points its table at them and adds 1 to their reference count::

    A: [7, 2, 9]         block 7 (ref 2) and 2 (ref 2) are shared:
    B: [7, 2, 4, 5]      B prefills only from position 32

When a request finishes, its blocks' counts drop; a block at 0 goes to the free queue
but keeps its hash, so a later request can still hit it, until the allocator needs a
fresh block and evicts the least recently freed one (LRU). The pieces are nano-vllm's
``block_manager.py`` and vLLM v1's ``KVCacheManager`` (``allocate_slots``, ``free``),
written small.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from ..block_hash import hash_block, salted_seed
from ..errors import check_positive_int


@dataclass
class Block:
    """One physical block of the pool.

    Attributes:
        block_id: its index in the pool tensors (0 .. num_blocks - 1).
        ref_count: how many requests' block tables hold it; 0 = in the free queue.
        block_hash: the chained hash of its tokens once it is full and computed, else None.
            A free block with a hash is *cached*: a request can still reuse it.
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockAllocator:
    """A pool of ``num_blocks`` blocks: a free queue, reference counts, the prefix-cache map.

    Args:
        num_blocks: blocks in the pool (vLLM's ``num_gpu_blocks``).
        block_size: positions per block (vLLM's ``block_size``; 16 by default there too).
        seed: the root hash of block chains (``block_hash.model_seed(model)``), so blocks of
            two models never match.
        enable_prefix_caching: share cached full blocks between requests (vLLM's name).

    Attributes:
        blocks: every :class:`Block`, indexed by block id.
        block_tables: request id -> its block table (physical block ids, in logical order).
        pending_copies: (source, destination) block pairs whose K/V the cache must copy before
            the next step (copy on write of a forked request's shared partial block).
        on_evict: None, or a function (block_id, block_hash) called when a cached block is handed
            out again, before anything overwrites its K/V: the eviction hook through which a KV
            offload (:mod:`minillm.serving.kv_tiers`) copies the block to the host tier.

    A request's cache salt (``cache_salt`` of :meth:`find_cached_prefix`, :meth:`cache_full_blocks`)
    roots its chain at ``block_hash.salted_seed(seed, salt)``: two salts never share a block.

    Raises ValueError for a non-positive ``num_blocks`` or ``block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int, seed: bytes = b"", enable_prefix_caching: bool = True):
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("block_size", block_size)
        self.num_blocks, self.block_size, self.seed = num_blocks, block_size, seed
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first: the next to be handed out (and
        # evicted, if cached). An OrderedDict so a cache hit can pull one out of the middle.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks so far
        self.pending_copies: list[tuple[int, int]] = []  # (source, destination) blocks copy_on_write queued
        self.on_evict = None

    # -- the pool, one block at a time -------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash, held or free: what a new request could hit."""
        return len(self.cached)

    def allocate_block(self) -> Block:
        """Take the least recently freed block (evicting its hash if it had one); ref_count 1.

        Raises RuntimeError when no block is free (callers check :attr:`num_free_blocks`).
        """
        if not self.free_queue:
            raise RuntimeError("no free KV cache block; check num_free_blocks before allocating")
        block = self.blocks[self.free_queue.popitem(last=False)[0]]
        if block.block_hash is not None:  # evict: this block's old contents are about to be overwritten
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        return block

    def share_block(self, block_id: int) -> None:
        """One more table holds ``block_id`` (a prefix-cache hit); a free one leaves the free queue."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def free_block(self, block_id: int) -> None:
        """One table lets go of ``block_id``; at 0 it joins the end of the free queue (kept cached).

        Raises RuntimeError for a block nobody holds (a double free would corrupt another request).
        """
        block = self.blocks[block_id]
        if block.ref_count < 1:
            raise RuntimeError(f"block {block_id} freed twice (its reference count is already 0)")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    # -- a request's blocks ------------------------------------------------------------

    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Block ids of the longest cached run of full blocks at the start of ``token_ids``.

        At most ``len(token_ids) - 1`` tokens are hits: the last token must still be computed,
        its logits give the next token (a prompt of N·block_size tokens hits at most N-1 blocks).
        ``cache_salt``: the request's salt (None: none); only blocks cached under it hit.
        """
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], salted_seed(self.seed, cache_salt)
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            parent = hash_block(parent, token_ids[start : start + self.block_size])
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Make room for a request to hold ``num_tokens`` positions in all; False if the pool is short.

        ``cached_blocks`` (a new request only): prefix-cache hits from :meth:`find_cached_prefix`,
        shared by reference at the start of its table. Then fresh blocks are added until the
        table covers ``num_tokens`` positions: ceil(num_tokens / block_size) blocks, the last
        one possibly partial. Nothing changes when it returns False.
        """
        table = self.block_tables.get(request_id, [])
        held = len(table) + len(cached_blocks)
        needed = blocks_needed(num_tokens, self.block_size) - held
        # A hit on a free cached block takes it out of the free queue: it no longer counts as free.
        free_hits = sum(self.blocks[b].ref_count == 0 for b in cached_blocks)
        if needed > self.num_free_blocks - free_hits:
            return False
        for block_id in cached_blocks:
            self.share_block(block_id)
        table = self.block_tables.setdefault(request_id, [])
        table.extend(cached_blocks)
        table.extend(self.allocate_block().block_id for _ in range(max(needed, 0)))
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                          cache_salt: str | None = None) -> list[int]:
        """Name every block of the request now full and computed (its K/V written) by its hash.

        ``token_ids``: the request's tokens (prompt + output); ``num_computed``: positions whose
        K/V are in the pool; ``cache_salt``: the request's salt (None: none). If another block
        already holds the same hash (two requests computed the same prefix in the same step), the
        first stays the cached one. Returns the ids of the blocks named now (what a disk tier
        writes through).
        """
        if not self.enable_prefix_caching:
            return []
        table, hashes = self.block_tables[request_id], self._hashes.setdefault(request_id, [])
        named = []
        for i in range(len(hashes), num_computed // self.block_size):
            parent = hashes[-1] if hashes else salted_seed(self.seed, cache_salt)
            h = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(h)
            block = self.blocks[table[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block.block_id
                named.append(block.block_id)
        return named

    # -- parallel sampling: one prompt, n sequences --------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the block table of ``parent_id``: the same blocks, each one's
        reference count raised by 1, nothing copied (the n sequences of a request with n > 1,
        forked after the prompt's prefill)::

            parent: [7, 2, 9]     blocks 7 and 2 (full) and 9 (partial) now have ref_count 2
            child:  [7, 2, 9]     the first write into 9 copies it (:meth:`copy_on_write`)
        """
        table = self.block_tables[parent_id]
        for block_id in table:
            self.share_block(block_id)
        self.block_tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))

    def copy_on_write(self, request_id: str, position: int) -> bool:
        """Before a request writes the K/V of ``position``: if another table holds the block it
        falls in (a partial block shared by :meth:`fork`), give this request a copy of its own.

        The new block's K/V must then be copied from the shared one before the step runs: the
        pair (source, destination) is queued in :attr:`pending_copies` (the cache's
        :meth:`~minillm.serving.paged_cache.PagedKVCache.copy_pending` does it). The last holder
        writes in place, with no copy. Only a fork shares a block that is written again: a
        prefix-cache hit is a full block, and writes start after it. False (nothing changed)
        when no block is free.
        """
        table = self.block_tables[request_id]
        logical = position // self.block_size
        if logical >= len(table) or self.blocks[table[logical]].ref_count == 1:
            return True
        if not self.free_queue:
            return False
        shared, copy = table[logical], self.allocate_block().block_id
        self.free_block(shared)
        table[logical] = copy
        self.pending_copies.append((shared, copy))
        return True

    def free(self, request_id: str) -> None:
        """Release every block of a request (finished, aborted or preempted).

        A request that holds no blocks (aborted while still waiting, or freed already) has nothing
        to release: no error. The table's blocks are freed last to first, so that under LRU a
        request's tail blocks (least likely shared) are evicted before its head (vLLM v1 frees in
        this order too).
        """
        for block_id in reversed(self.block_tables.pop(request_id, [])):
            self.free_block(block_id)
        self._hashes.pop(request_id, None)

    def usage(self) -> dict[str, int]:
        """Blocks used, free and cached (cached free blocks counted in both free and cached)."""
        return {"used": self.num_used_blocks, "free": self.num_free_blocks, "cached": self.num_cached_blocks}

    def __repr__(self) -> str:
        return (f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"used={self.num_used_blocks}, free={self.num_free_blocks}, cached={self.num_cached_blocks}, "
                f"requests={len(self.block_tables)})")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): a partial last block is a whole block (0 tokens: 0 blocks)."""
    return -(-num_tokens // block_size)


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The flat pool slot of each position in [start, end): block_table[p // B] · B + p % B.

    A slot numbers the pool's positions as if its blocks were laid end to end, so the
    K/V of position p of this request goes to block ``slot // B``, offset ``slot % B``::

        block_table [7, 2], B = 4:   positions 3, 4, 5  ->  slots 31, 8, 9

    Raises ValueError if a position falls beyond the table (allocate first).
    """
    if end > len(block_table) * block_size:
        raise ValueError(f"position {end - 1} is beyond the block table ({len(block_table)} blocks of "
                         f"{block_size}); allocate its blocks first")
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
