"""KV blocks beyond the pool: host memory, then disk; shared, crash-safe, pinned, loaded or recomputed.

One concept per file, in the order a block meets them:

    host.py         HostTier: blocks the pool evicted, in CPU memory, LRU within a byte bound
    disk.py         DiskTier: one checksummed file per block hash, atomic writes, shared by processes
    cache_point.py  CachePoint: a prefix a request asks to keep, pinned in the tiers for a lifetime
    decision.py     TierDecision, BandwidthMeter: load or recompute, with both predicted times
    offload.py      KVOffload: the pool's eviction hook, write-through, lookups, pins, close()

Every tier holds a block as two tensors k, v [n_layers, block_size, n_kv_heads, head_dim] in the
model's dtype (the pool's ``PagedKVCache.k[:, block_id]``), named by its chained hash
(:mod:`minillm.block_hash`), whose root carries the model and the request's cache salt.
"""

from .cache_point import CachePoint
from .decision import BandwidthMeter, TierDecision
from .disk import DiskTier
from .host import HostTier
from .offload import KVOffload

__all__ = ["BandwidthMeter", "CachePoint", "DiskTier", "HostTier", "KVOffload", "TierDecision"]
