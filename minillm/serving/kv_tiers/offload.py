"""KVOffload: the KV pool's blocks beyond the pool, in host memory and on disk, and back.

Where a block goes, and when::

    prefill computes a full block ──write-through──> disk          (when there is a disk tier)
    pool evicts a cached block ──copy──> host ──host evicts──> disk  (if not there already)
    a new request's chain: pool hits, then host, then disk ──load or recompute?──> fresh pool blocks
    engine.close(): every block still only in the pool or the host ──> disk

Write-through (LMCache stores on compute) is what lets a restarted process, or a second one on
the same folder, hit blocks the pool never evicted. It costs one copy, a sha256 and a file write
per block: for SmolLM2-135M float32 (720 KiB a block of 16) 2.0-2.1 ms (350-370 MB/s), against
270-340 ms to prefill those 16 tokens as part of a cold 2,000-token prompt (33-43 s) on a 2-core
VM with a load of 6-8: under 1% of the compute (``python benchmarks/kv_tiers.py`` measures both).

The allocator stays bookkeeping: it calls :meth:`KVOffload.offload_block` when it hands out a
cached block (its K/V about to be overwritten); the K/V copies are made here, through the
cache's :meth:`~minillm.serving.paged_cache.PagedKVCache.read_block` and ``write_block``.
"""

from __future__ import annotations

import itertools
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ...block_hash import block_hashes, salted_seed
from ...hardware import PROFILES, HardwareProfile, load_calibration
from ...whatif import load_or_recompute, prefill_floor_s
from ..paged_cache import PagedKVCache, free_memory_bytes, parse_memory
from .decision import BandwidthMeter, TierDecision
from .disk import DiskTier
from .host import HostTier

# A first guess at a disk's read bandwidth, bytes/s, until a load is measured: a SATA SSD's
# sequential read (~500 MB/s). NVMe reads 3-7 GB/s, the page cache tens of GB/s: the meter learns it.
DISK_BYTES_PER_S_GUESS = 500e6
COUNTS = ("host_hits", "disk_hits", "loaded_blocks", "recomputed_blocks", "offloaded_blocks", "disk_writes")


@dataclass
class _Loaded:
    tier: str
    k: torch.Tensor
    v: torch.Tensor
    read_s: float


@dataclass
class TierHits:
    """What :meth:`KVOffload.find` found for one request: blocks read (in chain order) and the decisions."""

    blocks: list[_Loaded] = field(default_factory=list)
    decisions: list[TierDecision] = field(default_factory=list)


class KVOffload:
    """The host and disk tiers of one engine's pool, and the moves between them.

    Args:
        cache: the engine's :class:`PagedKVCache` (its allocator gets the eviction hook).
        config: the model's config (for the recompute prediction).
        host, disk: the tiers; either may be None (not both).
        hardware: peaks for the recompute prediction (default: this machine's ``minillm calibrate``
            result, else a datasheet-style estimate: :func:`default_hardware`).
        clock: wall-clock seconds, for pins (tests inject one).

    Attributes:
        counts: {"host_hits", "disk_hits", "loaded_blocks", "recomputed_blocks", "offloaded_blocks",
            "disk_writes"}: blocks, since the engine started.
        bandwidth: {"host", "disk"} -> :class:`BandwidthMeter` (host starts from the calibrated copy
            bandwidth, disk from :data:`DISK_BYTES_PER_S_GUESS`).
        pins: block hash -> pinned until (Unix seconds), from cache points.
        prefill_floor_s, prefill_measured_s: the roofline floors and the measured times of the engine's
            prefill-only forward passes after the first (:meth:`record_prefill`): their ratio is
            :attr:`prefill_efficiency`, which scales the recompute prediction.
        first_prefill: (floor, measured) seconds of the first pass, the ratio until a second one comes.
    """

    def __init__(self, cache: PagedKVCache, config, host: HostTier | None = None, disk: DiskTier | None = None,
                 hardware: HardwareProfile | None = None, clock: Callable[[], float] = time.time):
        if host is None and disk is None:
            raise ValueError("a KV offload needs a host tier, a disk tier or both")
        self.cache, self.config, self.host, self.disk, self.clock = cache, config, host, disk, clock
        self.hardware = hardware or default_hardware(cache.k.device, cache.k.dtype)
        # A copy moves each byte twice (read + write): calibrate()'s bandwidth counts both.
        self.bandwidth = {"host": BandwidthMeter(self.hardware.mem_bandwidth / 2),
                          "disk": BandwidthMeter(DISK_BYTES_PER_S_GUESS)}
        self.counts = dict.fromkeys(COUNTS, 0)
        self.pins: dict[bytes, float] = {}
        self.decisions: list[TierDecision] = []
        self.prefill_floor_s = self.prefill_measured_s = 0.0
        self.first_prefill: tuple[float, float] | None = None
        cache.allocator.on_evict = self.offload_block

    @classmethod
    def create(cls, cache: PagedKVCache, model, memory: str | int | None, folder: str | Path | None,
               disk_size: str | int | None = None) -> "KVOffload | None":
        """The engine's offload from its arguments (None when memory and folder are None).

        ``memory``: the host tier's size, as ``kv_cache_memory`` ("2GiB", bytes, a fraction of free
        host memory); ``folder``: the disk tier's folder (created if missing); ``disk_size``: the disk
        tier's bound ("20GiB", bytes, a fraction of the disk's free space), None: unbounded.
        Raises ValueError for a bad size, a size that holds no block, a disk_size without a folder, or a
        folder that is a file or cannot be written.
        """
        if disk_size is not None and folder is None:
            raise ValueError(f"kv_offload_disk_size ({disk_size!r}) bounds the disk tier: give kv_offload_dir too")
        if memory is None and folder is None:
            return None
        host = None
        if memory is not None:
            try:
                capacity = parse_memory(memory, free_memory_bytes(torch.device("cpu")), "the host tier's size")
            except ValueError as error:
                raise ValueError(f"kv_offload_memory: {error}") from None
            if capacity < cache.bytes_per_block:
                raise ValueError(f"kv_offload_memory {memory!r} holds no block (one block is {cache.bytes_per_block} "
                                 "bytes); give more, e.g. 2GiB")
            host = HostTier(capacity)
        disk = None if folder is None else DiskTier.for_model(folder, model, cache.block_size)
        if disk is not None and disk_size is not None:
            disk.capacity_bytes = _disk_capacity(disk_size, disk)
        return cls(cache, model.config, host, disk)

    # -- down: the pool evicts, a block is computed ------------------------------------

    def offload_block(self, block_id: int, block_hash: bytes) -> None:
        """The allocator's eviction hook: copy the block's K/V to the host tier (what the host evicts, and
        the block itself without a host tier, goes to disk)."""
        k, v = self.cache.read_block(block_id)
        self.counts["offloaded_blocks"] += 1
        if self.host is None:
            self._to_disk(block_hash, k, v)
            return
        for h, hk, hv in self.host.put(block_hash, k, v, self._pin(block_hash)):
            self._to_disk(h, hk, hv)

    def write_through(self, block_ids) -> None:
        """Write newly computed cached blocks to the disk tier (what a restart or another process hits)."""
        if self.disk is None:
            return
        for block_id in reversed(block_ids):  # tail first: the head ends most recently used (touch_chain)
            block_hash = self.cache.allocator.blocks[block_id].block_hash
            if block_hash is not None and block_hash not in self.disk:
                self._to_disk(block_hash, *self.cache.read_block(block_id))

    def _to_disk(self, block_hash: bytes, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.disk is not None and block_hash not in self.disk:
            self.counts["disk_writes"] += self.disk.put(block_hash, k, v, self._pin(block_hash))

    # -- up: a new request's prefix ---------------------------------------------------

    def find(self, request_id: str, token_ids, cache_salt: str | None, first_block: int, max_blocks: int
             ) -> TierHits:
        """Continue a request's block chain past its ``first_block`` pool hits, through host then disk,
        up to ``max_blocks`` blocks in all: for each run of blocks in one tier, load or recompute by
        the cost model. Returns the blocks read (not yet in the pool: :meth:`place` puts them there)."""
        hits = TierHits()
        size = self.cache.block_size
        if max_blocks <= first_block:
            return hits
        root = salted_seed(self.cache.allocator.seed, cache_salt)
        hashes = block_hashes(token_ids[: max_blocks * size], size, root)
        tiers = []
        for block_hash in hashes[first_block:]:
            tier = self._tier_of(block_hash)
            if tier is None:
                break
            tiers.append(tier)
        start = first_block
        for tier, run in itertools.groupby(tiers):  # one decision per run of blocks in one tier
            count = len(list(run))
            decision = self._decide(request_id, tier, start, count)
            if decision.choice == "recompute":
                hits.decisions.append(decision)
                break
            read = self._read(tier, hashes[start : start + count])
            hits.decisions.append(replace(decision, loaded_blocks=len(read)))
            hits.blocks += read
            if len(read) < count:
                break
            start += count
        return hits

    def _tier_of(self, block_hash: bytes) -> str | None:
        if self.host is not None and block_hash in self.host:
            return "host"
        if self.disk is not None and block_hash in self.disk:
            return "disk"
        return None

    def record_prefill(self, chunks, seconds: float) -> None:
        """A prefill-only forward pass that took ``seconds``: ``chunks`` = (cached tokens before, tokens
        computed) per request. Adds its roofline floor and its time to the running totals.

        The engine's first prefill counts only until a second one is measured, as a benchmark's warm-up:
        it pays one-time costs (measured on SmolLM2: a first 2,000-token pass 6.8 s against 1.5 s for the
        next), which would predict a recompute several times slower than the engine's real one. Until
        then it is still a better guess than the roofline floor, which no CPU prefill reaches."""
        dtype_bytes = self.cache.k.element_size()
        floor_s = sum(prefill_floor_s(self.config, self.hardware, n, dtype_bytes, cached) for cached, n in chunks)
        if self.first_prefill is None:
            self.first_prefill = (floor_s, seconds)
            return
        self.prefill_floor_s += floor_s
        self.prefill_measured_s += seconds

    @property
    def prefill_efficiency(self) -> float:
        """The fraction of the roofline floor the engine's prefills reached so far (1 before any is measured):
        the measured load is weighed against a prefill as slow as this machine's, not an ideal one."""
        floor_s, measured_s = self.prefill_floor_s, self.prefill_measured_s
        if measured_s <= 0 and self.first_prefill is not None:
            floor_s, measured_s = self.first_prefill
        if measured_s <= 0 or floor_s <= 0:
            return 1.0
        return floor_s / measured_s

    def _decide(self, request_id: str, tier: str, first_block: int, num_blocks: int) -> TierDecision:
        size = self.cache.block_size
        answer = load_or_recompute(self.config, self.hardware, self.bandwidth[tier].bytes_per_s, num_blocks * size,
                                   first_block * size, self.cache.k.element_size(), self.prefill_efficiency)
        return TierDecision(request_id, tier, first_block, num_blocks, answer.kv_bytes, answer.load_ms,
                            answer.recompute_ms, answer.choice)

    def _read(self, tier: str, hashes: list[bytes]) -> list[_Loaded]:
        """The blocks' K/V in order, stopping at the first that cannot be read (gone, or corrupt)."""
        store = self.host if tier == "host" else self.disk
        read = []
        for block_hash in hashes:
            start = time.perf_counter()
            kv = store.get(block_hash)
            if kv is None:
                break
            read.append(_Loaded(tier, *kv, time.perf_counter() - start))
        touch_chain(store, hashes[: len(read)])
        return read

    def place(self, hits: TierHits, block_ids) -> None:
        """Copy the blocks :meth:`find` read into the request's fresh pool blocks (in order) and record
        the loads (counts, the tiers' bandwidth, the decisions for the step trace)."""
        for loaded, block_id in zip(hits.blocks, block_ids):
            start = time.perf_counter()
            self.cache.write_block(block_id, loaded.k, loaded.v)
            self.bandwidth[loaded.tier].record(loaded.k.nbytes + loaded.v.nbytes,
                                               loaded.read_s + time.perf_counter() - start)
            self.counts[f"{loaded.tier}_hits"] += 1
        self.counts["loaded_blocks"] += len(hits.blocks)
        self.counts["recomputed_blocks"] += sum(d.num_blocks for d in hits.decisions if d.choice == "recompute")
        self.decisions += hits.decisions

    def take_decisions(self) -> tuple[TierDecision, ...]:
        """The decisions since the last call (the engine puts them in the step's record)."""
        taken, self.decisions = tuple(self.decisions), []
        return taken

    # -- cache points -----------------------------------------------------------------

    def pin(self, hashes, pinned_until_s: float) -> None:
        """Keep these blocks in the host and disk tiers until ``pinned_until_s`` (Unix seconds), now and
        when they arrive there later; a pin is extended, never shortened."""
        now = self.clock()
        self.pins = {h: t for h, t in self.pins.items() if t > now}  # forget the expired ones
        for block_hash in hashes:
            self.pins[block_hash] = max(self.pins.get(block_hash, pinned_until_s), pinned_until_s)
            if self.host is not None:
                self.host.pin(block_hash, pinned_until_s)
            if self.disk is not None:
                self.disk.pin(block_hash, pinned_until_s)

    def _pin(self, block_hash: bytes) -> float | None:
        until = self.pins.get(block_hash)
        return until if until is not None and until > self.clock() else None

    # -- the end ------------------------------------------------------------------------

    def close(self) -> None:
        """Write every block still only in the pool or the host tier to the disk tier (idempotent)."""
        if self.disk is None:
            return
        allocator = self.cache.allocator
        for block_hash, block_id in list(allocator.cached.items()):
            if block_hash not in self.disk:
                self._to_disk(block_hash, *self.cache.read_block(block_id))
        for block_hash, entry in list(self.host.entries.items()) if self.host is not None else []:
            self._to_disk(block_hash, entry.k, entry.v)

    def __repr__(self) -> str:
        return f"KVOffload(host={self.host!r}, disk={self.disk!r}, counts={self.counts})"


def _disk_capacity(disk_size: str | int, disk: DiskTier) -> int:
    """The disk tier's bound in bytes: a size, or a fraction of the free space of the disk it is on.
    ValueError (one line) for a bad size or one that holds no block's file."""
    try:
        capacity = parse_memory(disk_size, shutil.disk_usage(disk.path).free, "the disk tier's size",
                                "free disk space")
    except ValueError as error:
        raise ValueError(f"kv_offload_disk_size: {error}") from None
    if capacity < disk.file_bytes:
        raise ValueError(f"kv_offload_disk_size {disk_size!r} holds no block (one block's file is {disk.file_bytes} "
                         "bytes); give more, e.g. 20GiB, or leave it out for no bound")
    return capacity


def default_hardware(device: torch.device, dtype: torch.dtype) -> HardwareProfile:
    """This machine's ``minillm calibrate`` result for device + dtype, else an estimate (nothing is measured
    here: the engine starts no benchmark): "laptop-cpu" on a CPU, "h100" on a GPU."""
    measured = load_calibration(device, dtype)
    if measured is not None:
        return measured
    return PROFILES["laptop-cpu" if torch.device(device).type == "cpu" else "h100"]


def touch_chain(store, hashes: list[bytes]) -> None:
    """Touch a chain's blocks tail first, so its head is the most recently used.

    A block is useful only with every block before it (a lookup starts at the head and stops at the
    first miss), so under a bound a chain should lose its tail before its head. LRU order does that
    when the head is touched last; a read in chain order would touch it first. (The pool frees a
    request's blocks tail first for the same reason.) Measured before: a 1-hour cache point larger
    than a 5 MiB disk bound kept its last 7 blocks, and after a restart read none of them.
    """
    for block_hash in reversed(hashes):
        store.touch(block_hash)
