"""The host tier: blocks the KV pool evicted, kept in CPU memory under a byte bound, LRU.

vLLM's CPU offloading (``--kv-offloading-size``) and SGLang's HiCache host pool, in small::

    pool evicts block h ──put──> [ h9 h4 h7 ... h2 ]  most recently used last
                                   ^ evicted first (LRU), unless pinned: then the next one
    a request's chain hits h4 ──get──> (k, v), h4 moves to the end

A pin (a cache point's lifetime) protects a block from unpinned blocks, not from other pinned ones:
when only pinned blocks are left to evict and a pinned block arrives, the least recently used pinned
one gives way. A tier cannot keep more than it holds, and refusing the newcomer instead is worse than
it looks: the pool gives up a chain's blocks tail first, so a tier that kept the first pinned blocks
to arrive held a long prompt's tail and refused its head, and a lookup, which starts at the head,
found nothing (measured with benchmarks/kv_tiers_workloads.py's document workload: 0 host hits,
against 135 with no cache points at all).

What it evicts to make room is returned to the caller, who sends it down to the disk tier.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import check_positive_int


@dataclass
class _Entry:
    k: torch.Tensor
    v: torch.Tensor
    pinned_until_s: float | None


class HostTier:
    """Blocks by hash in CPU memory, at most ``capacity_bytes`` of K and V, least recently used out first.

    Args:
        capacity_bytes: the bound, bytes of K plus V (an int >= 1; the engine parses "2GiB").
        clock: seconds now, for pins (``time.time``, wall-clock, as the disk tier's; tests inject one).

    A block's payload is two tensors k, v [n_layers, block_size, n_kv_heads, head_dim] in the
    model's dtype; the tier keeps the tensors it is given (the caller hands over copies).
    Raises ValueError for a capacity that is not a positive int.
    """

    def __init__(self, capacity_bytes: int, clock: Callable[[], float] = time.time):
        check_positive_int("capacity_bytes", capacity_bytes)
        self.capacity_bytes, self.clock = capacity_bytes, clock
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.bytes_used = 0

    def get(self, block_hash: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) of a block, now the most recently used; None when the tier does not hold it."""
        entry = self.entries.get(block_hash)
        if entry is None:
            return None
        self.entries.move_to_end(block_hash)
        return entry.k, entry.v

    def put(self, block_hash: bytes, k: torch.Tensor, v: torch.Tensor, pinned_until_s: float | None = None
            ) -> list[tuple[bytes, torch.Tensor, torch.Tensor]]:
        """Store a block (most recently used); returns the (hash, k, v) it evicted to make room.

        LRU order, skipping blocks pinned until after now; for a pinned block, then the pinned ones too
        (see the module docstring). A block that still does not fit (larger than the tier, or unpinned
        with everything else pinned) is not stored: it comes back in the list itself. A block already
        held is touched and its pin extended, not stored twice.
        """
        if block_hash in self.entries:
            self.pin(block_hash, pinned_until_s)
            self.entries.move_to_end(block_hash)
            return []
        size = k.nbytes + v.nbytes
        evicted = self._make_room(size, evict_pinned=False)
        if pinned_until_s is not None and pinned_until_s > self.clock():
            evicted += self._make_room(size, evict_pinned=True)
        if self.bytes_used + size > self.capacity_bytes:
            return evicted + [(block_hash, k, v)]
        self.entries[block_hash] = _Entry(k, v, pinned_until_s)
        self.bytes_used += size
        return evicted

    def touch(self, block_hash: bytes) -> None:
        """Make a held block the most recently used (nothing for one not held)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)

    def pin(self, block_hash: bytes, pinned_until_s: float | None) -> bool:
        """Keep a held block until ``pinned_until_s`` (never shortens a pin); False when not held."""
        entry = self.entries.get(block_hash)
        if entry is None:
            return False
        if pinned_until_s is not None:
            entry.pinned_until_s = max(entry.pinned_until_s or pinned_until_s, pinned_until_s)
        return True

    def _make_room(self, size: int, evict_pinned: bool) -> list[tuple[bytes, torch.Tensor, torch.Tensor]]:
        evicted, now = [], self.clock()
        for block_hash in list(self.entries):
            if self.bytes_used + size <= self.capacity_bytes:
                break
            entry = self.entries[block_hash]
            if not evict_pinned and entry.pinned_until_s is not None and entry.pinned_until_s > now:
                continue
            del self.entries[block_hash]
            self.bytes_used -= entry.k.nbytes + entry.v.nbytes
            evicted.append((block_hash, entry.k, entry.v))
        return evicted

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"HostTier({len(self)} blocks, {self.bytes_used} / {self.capacity_bytes} bytes)"
