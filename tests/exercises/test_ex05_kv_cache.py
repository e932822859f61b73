"""Exercise 5: the KV cache: write new K/V at ``length``, return and read the filled part."""

import pytest
import torch

from exercises.checking import Case
from exercises.models import randn

pytestmark = pytest.mark.ex05
LESSON = "lessons/03-kv-cache.md#writing-and-reading"
SHAPES = "cache k, v: [n_layers=2, batch=1, n_kv_heads=2, max_seq_len=8, head_dim=4]; new k, v: [1, 2, T, 4]"
WRITE = ("write stores k, v at positions length .. length+T-1 of this layer and returns this layer's "
         "positions 0 .. length+T-1 (the cached ones and the new ones); length moves only in advance()")


def new_cache(impl):
    return impl.KVCache(n_layers=2, batch_size=1, n_kv_heads=2, max_seq_len=8, head_dim=4)


def kv(T: int, seed: int):
    return randn(2, 1, 2, T, 4, seed=seed).unbind(0)


def prefill_3(c, cache):
    """Both layers write 3 positions, then the cache advances: what a 3-token prefill does."""
    k0, v0 = kv(3, seed=0)
    k1, v1 = kv(3, seed=1)
    c.call(cache.write, 0, k0, v0)
    c.call(cache.write, 1, k1, v1)
    cache.advance(3)
    return (k0, v0), (k1, v1)


def test_first_write_returns_the_new_entries(impl):
    c = Case("cache.write(0, k, v)", "an empty cache, a 3-token prompt", shapes=SHAPES, hint=WRITE, lesson=LESSON)
    cache = new_cache(impl)
    k, v = kv(3, seed=0)
    got_k, got_v = c.call(cache.write, 0, k, v)
    c.close(got_k, k)
    c.close(got_v, v)


def test_a_decode_write_is_appended_after_the_prompt(impl):
    c = Case("cache.write(0, k, v)", "after a 3-token prefill, 1 decode token", shapes=SHAPES, hint=WRITE,
             lesson=LESSON)
    cache = new_cache(impl)
    (k0, v0), _ = prefill_3(c, cache)
    k, v = kv(1, seed=2)
    got_k, got_v = c.call(cache.write, 0, k, v)
    c.close(got_k, torch.cat([k0, k], dim=2))
    c.close(got_v, torch.cat([v0, v], dim=2))


def test_write_leaves_length_to_advance(impl):
    c = Case("cache.write(...) then cache.advance(3)", "a 3-token prefill through 2 layers", shapes=SHAPES,
             lesson=LESSON, hint="every layer writes at the same positions, so write() must not move length: "
                                 "the model calls advance(T) once, after the last layer")
    cache = new_cache(impl)
    prefill_3(c, cache)
    c.equal(cache.length, 3)


def test_keys_and_values_are_the_filled_part(impl):
    c = Case("cache.keys(layer), cache.values(layer)", "after a 3-token prefill; max_seq_len is 8",
             shapes=SHAPES + "; keys(layer): [1, 2, length=3, 4]", lesson=LESSON,
             hint="return only positions 0 .. length-1 of that layer (a view): the free positions hold zeros "
                  "that attention must never see")
    cache = new_cache(impl)
    (k0, v0), (k1, v1) = prefill_3(c, cache)
    c.close(c.call(cache.keys, 0), k0)
    c.close(c.call(cache.values, 0), v0)
    c.close(c.call(cache.keys, 1), k1)
    c.close(c.call(cache.values, 1), v1)


def test_prefill_then_three_decode_steps(impl):
    c = Case("write / advance, 1 prefill of 3 tokens then 3 decode steps", "the whole life of a request",
             shapes=SHAPES, hint=WRITE, lesson=LESSON)
    cache = new_cache(impl)
    (k0, v0), (k1, v1) = prefill_3(c, cache)
    keys = [k0, k1]
    for step in range(3):
        for layer in range(2):
            k, v = kv(1, seed=10 + 2 * step + layer)
            got_k, _ = c.call(cache.write, layer, k, v)
            keys[layer] = torch.cat([keys[layer], k], dim=2)
            c.close(got_k, keys[layer])
        cache.advance(1)
    c.equal(cache.length, 6)
    c.close(c.call(cache.keys, 1), keys[1])


def test_a_batch_of_three_sequences(impl):
    c = Case("cache.write(layer, k, v) with batch 3", "3 sequences decoded together: a 2-token prefill, then "
             "1 decode token, each sequence with its own K/V",
             shapes="cache k, v: [2, batch=3, 2, 8, 4]; new k, v: [3, 2, T, 4]", lesson=LESSON,
             hint="write every sequence of the batch: self.k[layer, :, :, length:length+T] = k (the ':' on the "
                  "batch dimension), not only sequence 0")
    cache = impl.KVCache(n_layers=2, batch_size=3, n_kv_heads=2, max_seq_len=8, head_dim=4)
    k0, v0 = randn(2, 3, 2, 2, 4, seed=20).unbind(0)
    for layer in range(2):
        c.call(cache.write, layer, k0, v0)
    cache.advance(2)
    k1, v1 = randn(2, 3, 2, 1, 4, seed=21).unbind(0)
    got_k, got_v = c.call(cache.write, 1, k1, v1)
    c.close(got_k, torch.cat([k0, k1], dim=2))
    c.close(got_v, torch.cat([v0, v1], dim=2))
    c.close(c.call(cache.keys, 0), k0)
    c.close(c.call(cache.values, 1), v0)


def test_far_from_position_0_in_each_dtype(impl):
    for dtype in (torch.float32, torch.bfloat16):
        c = Case(f"cache.write(0, k, v), a {str(dtype)[6:]} cache", "500 positions already filled (max_seq_len "
                 "512), then a 3-token write at positions 500, 501, 502",
                 shapes=f"cache k, v: [1, 1, 2, 512, 4] {str(dtype)[6:]}; new k, v: [1, 2, 3, 4]", lesson=LESSON,
                 hint=WRITE + "; the views keep the cache's dtype (no float32 copy of a bfloat16 cache)")
        cache = impl.KVCache(n_layers=1, batch_size=1, n_kv_heads=2, max_seq_len=512, head_dim=4, dtype=dtype)
        old = randn(2, 1, 2, 500, 4, seed=22).to(dtype)
        cache.k[0, :, :, :500], cache.v[0, :, :, :500] = old[0], old[1]
        cache.advance(500)
        k, v = randn(2, 1, 2, 3, 4, seed=23).to(dtype).unbind(0)
        got_k, got_v = c.call(cache.write, 0, k, v)
        c.equal(got_k, torch.cat([old[0], k], dim=2))
        c.equal(got_v, torch.cat([old[1], v], dim=2))
        c.equal(c.call(cache.keys, 0), old[0])
