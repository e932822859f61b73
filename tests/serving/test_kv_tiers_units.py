"""The small parts of the KV tiers: the host tier's edges, CachePoint, the bandwidth meter."""

import pytest
import torch

from minillm.serving.kv_tiers import BandwidthMeter, CachePoint, HostTier

SHAPE = (2, 4, 1, 8)  # 256 bytes a tensor in float32, 512 a block


def kv(value):
    return torch.full(SHAPE, float(value)), torch.full(SHAPE, -float(value))


def test_host_tier_keeps_the_given_tensors_and_reports_what_it_evicts():
    tier = HostTier(1024)
    assert tier.put(b"a", *kv(1)) == [] and tier.put(b"b", *kv(2)) == []
    assert tier.bytes_used == 1024 and len(tier) == 2 and b"a" in tier
    k, v = tier.get(b"a")  # a is now the most recently used: b goes first
    assert torch.equal(k, kv(1)[0]) and torch.equal(v, kv(1)[1])
    evicted = tier.put(b"c", *kv(3))
    assert [h for h, _, _ in evicted] == [b"b"] and torch.equal(evicted[0][1], kv(2)[0])
    assert tier.put(b"a", *kv(9)) == [] and torch.equal(tier.get(b"a")[0], kv(1)[0])  # held: not stored twice
    assert tier.get(b"zz") is None


def test_host_tier_returns_a_block_that_cannot_fit():
    tier = HostTier(512)
    big = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
    assert [h for h, _, _ in tier.put(b"big", *big)] == [b"big"] and len(tier) == 0
    now = [0.0]
    tier = HostTier(512, clock=lambda: now[0])
    tier.put(b"a", *kv(1), pinned_until_s=10.0)
    assert [h for h, _, _ in tier.put(b"b", *kv(2))] == [b"b"]  # a is pinned: b does not fit
    now[0] = 11.0
    assert [h for h, _, _ in tier.put(b"b", *kv(2))] == [b"a"] and b"b" in tier


def test_pinned_blocks_give_way_to_a_pinned_newcomer_least_recently_used_first():
    """A long prompt's pinned blocks reach a tier tail first: kept whole, the first to arrive (the tail)
    would refuse the head, which a lookup needs first."""
    now = [0.0]
    tier = HostTier(1024, clock=lambda: now[0])  # two blocks of 512 bytes
    tier.put(b"tail", *kv(1), pinned_until_s=10.0)
    tier.put(b"middle", *kv(2), pinned_until_s=10.0)
    assert [h for h, _, _ in tier.put(b"head", *kv(3), pinned_until_s=10.0)] == [b"tail"]
    assert [h for h, _, _ in tier.put(b"other", *kv(4))] == [b"other"]  # unpinned: still refused


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, "1GiB"])
def test_host_tier_capacity_must_be_a_positive_int(capacity):
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostTier(capacity)


@pytest.mark.parametrize("text, seconds", [("5m", 300.0), ("1h", 3600.0), ("90s", 90.0), (" 1.5h ", 5400.0)])
def test_parse_ttl(text, seconds):
    assert CachePoint.parse_ttl(text) == seconds


@pytest.mark.parametrize("text", ["5", "5d", "-5m", "0m", "", "m", None])
def test_parse_ttl_refuses_anything_else(text):
    with pytest.raises(ValueError, match="5m"):
        CachePoint.parse_ttl(text)


@pytest.mark.parametrize("num_tokens, ttl_s", [(0, 60), (1.0, 60), (True, 60), (10, 0), (10, float("inf")),
                                               (10, "5m"), (10, float("nan"))])
def test_cache_point_fields_are_checked(num_tokens, ttl_s):
    with pytest.raises(ValueError, match="cache point"):
        CachePoint(num_tokens, ttl_s)


def test_cache_point_defaults_to_five_minutes_and_is_frozen():
    point = CachePoint(100)
    assert point.ttl_s == 300.0
    with pytest.raises(AttributeError):
        point.num_tokens = 5


def test_bandwidth_meter_uses_the_estimate_until_a_load_is_measured():
    meter = BandwidthMeter(1e9)
    assert meter.bytes_per_s == 1e9
    meter.record(1000, 0.5)
    meter.record(3000, 1.5)
    assert meter.bytes_per_s == 2000.0
    with pytest.raises(ValueError, match="initial_bytes_per_s"):
        BandwidthMeter(0)
