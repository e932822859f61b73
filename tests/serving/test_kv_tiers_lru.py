"""The host and disk tiers' eviction against a reference LRU with pins (hypothesis).

The reference is a plain list, least recently used first: a put of a new block appends it, then
removes from the front the blocks not pinned beyond now while more than ``capacity`` blocks are
held; if everything else is pinned, a pinned new block then removes pinned ones from the front (pins
give way to each other), an unpinned one goes itself (it does not fit); a get or a
second put of a held block moves it to the end. Both tiers hold equal-sized blocks, so the byte
bound is a count of blocks. The clock is injected and ticks once per operation.
"""

import tempfile

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.serving.kv_tiers import DiskTier, HostTier

SHAPE = [2, 4, 1, 8]  # [n_layers, block_size, n_kv_heads, head_dim]
CAPACITY_BLOCKS = 3


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


class ReferenceLRU:
    def __init__(self, capacity):
        self.capacity, self.order, self.pins = capacity, [], {}

    def put(self, name, pin, now):
        if name in self.order:
            if pin is not None:
                self.pins[name] = max(self.pins.get(name, pin), pin)
            self.get(name)
            return
        for evict_pinned in (False, pin is not None and pin > now):
            for held in list(self.order):
                if len(self.order) < self.capacity:
                    break
                if evict_pinned or self.pins.get(held, 0) <= now:
                    self.order.remove(held)
        if len(self.order) < self.capacity:
            self.order.append(name)
            self.pins[name] = pin or 0

    def get(self, name):
        if name not in self.order:
            return False
        self.order.remove(name)
        self.order.append(name)
        return True


def block(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


ops = st.lists(st.tuples(st.sampled_from(["put", "put_pinned", "get"]), st.integers(0, 6)), max_size=40)


def run_against_reference(tier, clock, sequence):
    ref = ReferenceLRU(CAPACITY_BLOCKS)
    for op, i in sequence:
        clock.now += 1
        name = bytes([i]) * 32
        if op == "get":
            got = tier.get(name)
            assert (got is not None) == ref.get(name)
            if got is not None:  # the block's own bytes, never another's
                assert all(torch.equal(a, b) for a, b in zip(got, block(i)))
        else:
            pin = clock.now + 5 if op == "put_pinned" else None
            tier.put(name, *block(i), pinned_until_s=pin)
            ref.put(name, pin, clock.now)
        assert ref.order == [n for n in ref.order if n in tier]
        assert len(tier) == len(ref.order)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_host_tier_is_lru_with_pins(sequence):
    clock = Clock()
    k, v = block(0)
    run_against_reference(HostTier(CAPACITY_BLOCKS * (k.nbytes + v.nbytes), clock), clock, sequence)


@settings(max_examples=100, deadline=None)
@given(ops)
def test_disk_tier_is_lru_with_pins(sequence):
    clock = Clock()
    with tempfile.TemporaryDirectory() as folder:
        key = {"seed": "00", "dtype": "float32", "block_size": 4, "shape": SHAPE}
        probe = DiskTier(folder + "/probe", key)
        probe.put(b"p" * 32, *block(0))
        file_bytes = probe.bytes_used
        tier = DiskTier(folder + "/tier", key, CAPACITY_BLOCKS * file_bytes, clock)
        run_against_reference(tier, clock, sequence)
        assert tier.bytes_used <= CAPACITY_BLOCKS * file_bytes
