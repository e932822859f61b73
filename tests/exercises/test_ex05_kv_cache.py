"""Exercise 5: the KV cache: write new K/V at ``length``, return and read the filled part."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.models import randn
from exercises.registry import EXERCISES, reference

pytestmark = pytest.mark.ex05
REF = reference(EXERCISES["ex05"])
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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


# -- a stateful check (issue 30): random sequences of operations on yours and the reference side by side ----


def shares_storage(views, cache, name: str):
    """``check`` for agree: each returned tensor is a view of the cache's own k (or v) buffer, as promised."""
    def check(args, kwargs, got):
        pairs = zip(got, (cache.k, cache.v)) if isinstance(got, tuple) else [(got, getattr(cache, views))]
        for tensor, buffer in pairs:
            if isinstance(tensor, torch.Tensor) and tensor.numel() and \
                    tensor.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
                return (f"{name} returned a copy: the docstring promises a view of the cache's own buffer "
                        "(self.k[layer, :, :, :end], no torch.cat or clone), so reading costs no memory traffic")
        return None
    return check


@given(data=st.data())
@CHECKS
def test_random_sequences_of_writes_and_reads_agree_with_the_reference(impl, data):
    shape = dict(n_layers=data.draw(st.integers(1, 3), label="n_layers"),
                 batch_size=data.draw(st.integers(1, 3), label="batch_size"),
                 n_kv_heads=data.draw(st.integers(1, 2), label="n_kv_heads"),
                 max_seq_len=data.draw(st.integers(1, 12), label="max_seq_len"),
                 head_dim=data.draw(st.sampled_from([1, 2, 4]), label="head_dim"),
                 dtype=data.draw(st.sampled_from(DTYPES), label="dtype"))
    B, H, D, dtype, L = shape["batch_size"], shape["n_kv_heads"], shape["head_dim"], shape["dtype"], shape["max_seq_len"]
    yours, ref = impl.KVCache(**shape), REF.KVCache(**shape)
    history = ["cache = KVCache(" + ", ".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in shape.items()) + ")"]
    hint = (WRITE + "; past max_seq_len, write raises CacheFullError and writes nothing; keys(layer) and "
            "values(layer) are views of positions 0 .. length-1; every sequence of the batch, every layer, any dtype")

    def doing(call: str) -> str:
        return "; ".join(history) + "; then cache." + call

    def same_length(after: str):
        if yours.length != ref.length:
            Case("; ".join(history), "a random sequence of cache operations (the smallest hypothesis found)",
                 hint=hint, lesson=LESSON).fail(f"length is {yours.length} after {after}, expected {ref.length}",
                                                ref.length, yours.length)

    def write(layer: int, T: int, seed: int) -> bool:
        """Both caches write; True when the reference wrote (False: it raised, as it must past capacity)."""
        def inputs():
            g = torch.Generator().manual_seed(seed)
            return (layer, torch.randn(B, H, T, D, generator=g).to(dtype),
                    torch.randn(B, H, T, D, generator=g).to(dtype)), {}
        ok = ref.length + T <= L
        agree(yours.write, ref.write, inputs, what=doing("write"), exercise="ex05", lesson=LESSON, hint=hint,
              check=shares_storage(None, yours, "write"))
        history.append(f"write({layer}, k, v with T={T})")
        same_length(history[-1])
        return ok

    for _ in range(data.draw(st.integers(1, 10), label="operations")):
        op = data.draw(st.sampled_from(["pass", "pass", "write", "advance", "keys", "values", "truncate"]), label="op")
        if op == "pass":  # a forward pass: every layer writes T positions, then the model advances once
            T = data.draw(st.just(1) | st.integers(1, L + 1), label="T")
            seed = data.draw(st.integers(0, 2**16), label="seed")
            if all([write(layer, T, seed + layer) for layer in range(shape["n_layers"])]):
                yours.advance(T), ref.advance(T)
                history.append(f"advance({T})")
        elif op == "write":  # one layer alone (a pass cut short): length must not move
            layer = data.draw(st.integers(0, shape["n_layers"] - 1), label="layer")
            write(layer, data.draw(st.integers(1, L + 1), label="T"), data.draw(st.integers(0, 2**16), label="seed"))
        elif op == "advance":
            n = data.draw(st.integers(0, L - ref.length), label="n")
            yours.advance(n), ref.advance(n)
            history.append(f"advance({n})")
        elif op == "truncate":
            n = data.draw(st.integers(0, ref.length), label="n")
            yours.truncate(n), ref.truncate(n)
            history.append(f"truncate({n})")
        else:
            layer = data.draw(st.integers(0, shape["n_layers"] - 1), label="layer")
            agree(getattr(yours, op), getattr(ref, op), lambda: ((layer,), {}), what=doing(op), exercise="ex05",
                  lesson=LESSON, hint=hint, check=shares_storage("k" if op == "keys" else "v", yours, op))
        same_length(history[-1])
