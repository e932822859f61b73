"""Exercise 15: the block allocator of a paged KV cache: block counts, slots, reference counts.

Write ``blocks_needed`` and ``slot_mapping`` (block arithmetic), then three methods of the
``BlockAllocator``. The class inherits minillm's: ``__init__`` makes ``self.blocks`` (one
:class:`Block` per id, with ``ref_count`` and ``block_hash``), ``self.free_queue`` (an OrderedDict
of the ids with ref_count 0, least recently freed first) and ``self.block_tables`` (request id ->
its block ids); ``allocate_block()`` takes the head of the free queue (ref_count 1),
``share_block(id)`` adds one reference (a free block leaves the queue), ``num_free_blocks`` counts
the queue. Write ``allocate_slots``, ``free_block`` and ``free`` (``free`` also forgets the
request's block hashes: ``self._hashes.pop(request_id, None)``)::

    free queue (head = next to hand out)        block tables        ref counts
    [4, 5, 6, 7]                                A: [0, 1, 2]        0:2  1:1  2:1  3:1
                                                B: [0, 3]           (block 0 is shared)
    free("A") -> tail blocks first:  [4, 5, 6, 7, 2, 1]             0:1  3:1  (0 stays: B holds it)

Check:      minillm check ex15   (or: pytest tests/exercises -m ex15 --impl student)
Lesson:     lessons/11-serving.md#paged-kv-cache
Reference:  minillm.serving.block_allocator
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

from typing import Sequence

from minillm.serving import block_allocator
from minillm.serving.block_allocator import Block  # noqa: F401


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): a partial last block is a whole block (0 tokens: 0 blocks)."""
    if num_tokens <= 0:
        return 0
    return (num_tokens + block_size - 1) // block_size


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The flat pool slot of each position in [start, end): block_table[p // B] · B + p % B.

    A slot numbers the pool's positions as if its blocks were laid end to end, so the
    K/V of position p of this request goes to block ``slot // B``, offset ``slot % B``::

        block_table [7, 2], B = 4:   positions 3, 4, 5  ->  slots 31, 8, 9

    Raises ValueError if a position falls beyond the table (allocate first).
    """
    slots = []
    for p in range(start, end):
        i = p // block_size
        if i >= len(block_table):
            raise ValueError(f"position {p} is beyond the block table ({len(block_table)} blocks of {block_size})")
        slots.append(block_table[i] * block_size + p % block_size)
    return slots


class BlockAllocator(block_allocator.BlockAllocator):
    """minillm's BlockAllocator (the pool, allocate_block, share_block); allocate_slots, free_block, free are yours."""

    def allocate_slots(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Make room for a request to hold ``num_tokens`` positions in all; False if the pool is short.

        ``cached_blocks`` (a new request only): prefix-cache hits from :meth:`find_cached_prefix`,
        shared by reference at the start of its table. Then fresh blocks are added until the
        table covers ``num_tokens`` positions: ceil(num_tokens / block_size) blocks, the last
        one possibly partial. Nothing changes when it returns False.
        """
        table = self.block_tables.get(request_id)
        new_cached = [] if table is not None else list(cached_blocks)
        have = (len(table) if table is not None else 0) + len(new_cached)
        fresh = max(0, blocks_needed(num_tokens, self.block_size) - have)
        taken_from_free = sum(1 for b in new_cached if self.blocks[b].ref_count == 0)
        if fresh + taken_from_free > self.num_free_blocks:
            return False
        if table is None:
            table = []
            self.block_tables[request_id] = table
        for b in new_cached:
            self.share_block(b)
            table.append(b)
        for _ in range(fresh):
            table.append(self.allocate_block().block_id)
        return True

    def free_block(self, block_id: int) -> None:
        """One table lets go of ``block_id``; at 0 it joins the end of the free queue (kept cached).

        Raises RuntimeError for a block nobody holds (a double free would corrupt another request).
        """
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise ValueError(f"block {block_id} is not held by anyone (double free?)")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def free(self, request_id: str) -> None:
        """Release every block of a request (finished, aborted or preempted).

        A request that holds no blocks (aborted while still waiting, or freed already) has nothing
        to release: no error. The table's blocks are freed last to first, so that under LRU a
        request's tail blocks (least likely shared) are evicted before its head (vLLM v1 frees in
        this order too).
        """
        table = self.block_tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if not table:
            return
        for block_id in reversed(table):
            self.free_block(block_id)
