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
    raise NotImplementedError(
        "Exercise 15 (block allocator) is not written yet: see lessons/11-serving.md#paged-kv-cache"
    )


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The flat pool slot of each position in [start, end): block_table[p // B] · B + p % B.

    A slot numbers the pool's positions as if its blocks were laid end to end, so the
    K/V of position p of this request goes to block ``slot // B``, offset ``slot % B``::

        block_table [7, 2], B = 4:   positions 3, 4, 5  ->  slots 31, 8, 9

    Raises ValueError if a position falls beyond the table (allocate first).
    """
    raise NotImplementedError(
        "Exercise 15 (block allocator) is not written yet: see lessons/11-serving.md#paged-kv-cache"
    )


class BlockAllocator(block_allocator.BlockAllocator):
    """minillm's BlockAllocator (the pool, allocate_block, share_block); allocate_slots, free_block, free are yours."""

    def allocate_slots(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Make room for a request to hold ``num_tokens`` positions in all; False if the pool is short.

        ``cached_blocks`` (a new request only): prefix-cache hits from :meth:`find_cached_prefix`,
        shared by reference at the start of its table. Then fresh blocks are added until the
        table covers ``num_tokens`` positions: ceil(num_tokens / block_size) blocks, the last
        one possibly partial. Nothing changes when it returns False.
        """
        raise NotImplementedError(
            "Exercise 15 (block allocator) is not written yet: see lessons/11-serving.md#paged-kv-cache"
        )

    def free_block(self, block_id: int) -> None:
        """One table lets go of ``block_id``; at 0 it joins the end of the free queue (kept cached).

        Raises RuntimeError for a block nobody holds (a double free would corrupt another request).
        """
        raise NotImplementedError(
            "Exercise 15 (block allocator) is not written yet: see lessons/11-serving.md#paged-kv-cache"
        )

    def free(self, request_id: str) -> None:
        """Release every block of a request (finished, aborted or preempted).

        A request that holds no blocks (aborted while still waiting, or freed already) has nothing
        to release: no error. The table's blocks are freed last to first, so that under LRU a
        request's tail blocks (least likely shared) are evicted before its head (vLLM v1 frees in
        this order too).
        """
        raise NotImplementedError(
            "Exercise 15 (block allocator) is not written yet: see lessons/11-serving.md#paged-kv-cache"
        )
