"""Exercise 11: prefix-cache block hashes and the longest cached prefix."""

import hashlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.models import prompt, tiny_model
from exercises.registry import EXERCISES, reference
from minillm import KVCache
from minillm.block_hash import block_hashes, hash_block, model_seed
from minillm.phases import prefill
from minillm.prefix_cache import PrefixCache

pytestmark = pytest.mark.ex11
LESSON = "lessons/08-prompt-caching.md"
SEED = hashlib.sha256(b"a model").digest()
CHAIN = ("h_i = hash_fn(h_{i-1}, tokens of block i, extra_keys) with h_{-1} = seed: each hash covers its "
         "block AND every token before it; only full blocks get a hash")
RULE = ("walk the blocks from the first and stop at the first miss; count whole blocks only; leave at "
        "least one token to prefill: at most (n_tokens - 1) // block_size blocks")


def short(hashes):
    return [h.hex()[:8] for h in hashes]


def test_one_hash_per_full_block(impl):
    ids = list(range(10, 20))
    c = Case("block_hashes(ids, block_size=4, seed)", "10 tokens: 2 full blocks and 2 leftover tokens",
             shapes="-> a list of 2 hashes (32 bytes each), root first", hint=CHAIN,
             lesson=LESSON + "#block-hashes")
    h0 = hash_block(SEED, ids[0:4], ())
    h1 = hash_block(h0, ids[4:8], ())
    got = c.call(impl.block_hashes, ids, 4, SEED)
    c.equal(short(got), short([h0, h1]))


def test_hashes_are_chained(impl):
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 4, 5, 6, 7, 8]
    c = Case("block_hashes(ids, block_size=4, seed)", "two prompts whose 2nd blocks are equal, 1st blocks differ",
             shapes="8 tokens -> 2 hashes", lesson=LESSON + "#block-hashes",
             hint=CHAIN + ": equal tokens after different prefixes have different K/V, so different hashes")
    ha, hb = c.call(impl.block_hashes, a, 4, SEED), c.call(impl.block_hashes, b, 4, SEED)
    c.true(len(ha) == len(hb) == 2, "wrong number of hashes", expected=2, got=(len(ha), len(hb)))
    c.true(ha[1] != hb[1], "block 1 got the same hash after different block 0s", expected="different hashes",
           got=short([ha[1], hb[1]]))


def test_extra_keys_and_hash_fn_are_passed_on(impl):
    calls = []

    def recording_hash(parent, tokens, extra_keys):
        calls.append((parent[:2], tuple(tokens), extra_keys))
        return bytes([len(calls)]) * 32

    c = Case("block_hashes(ids, 3, seed, extra_keys=('lora-1',), hash_fn=recording_hash)",
             "7 tokens with block_size 3 and an extra key", shapes="-> 2 hashes", lesson=LESSON + "#block-hashes",
             hint="call hash_fn(parent, block tokens, extra_keys) once per full block, root first, parent = seed "
                  "for the first block, then the previous block's hash")
    c.call(impl.block_hashes, [1, 2, 3, 4, 5, 6, 7], 3, SEED, ("lora-1",), recording_hash)
    expected = [(SEED[:2], (1, 2, 3), ("lora-1",)), (bytes([1, 1]), (4, 5, 6), ("lora-1",))]
    c.equal(calls, expected)


def test_hit_stops_at_the_first_miss(impl):
    hashes = block_hashes(list(range(13)), 4, SEED)  # 3 full blocks, 1 leftover token
    c = Case("longest_cached_prefix(hashes, cached, n_tokens=13, block_size=4)",
             "blocks 0 and 2 cached, block 1 not", shapes="3 block hashes; returns cached_tokens",
             hint=RULE + "; block 2 is useless without block 1 (its K/V were computed after block 1's)",
             lesson=LESSON + "#longest-cached-prefix")
    c.equal(c.call(impl.longest_cached_prefix, hashes, {hashes[0], hashes[2]}, 13, 4), 4)
    c.equal(c.call(impl.longest_cached_prefix, hashes, {hashes[1], hashes[2]}, 13, 4), 0)


def test_a_partial_block_never_counts(impl):
    hashes = block_hashes(list(range(10)), 4, SEED)
    c = Case("longest_cached_prefix(hashes, cached, n_tokens=10, block_size=4)",
             "10 tokens: 2 full blocks, both cached, and 2 leftover tokens", shapes="2 block hashes",
             hint=RULE + ": the leftover tokens 8, 9 are not a block and are prefilled",
             lesson=LESSON + "#longest-cached-prefix")
    c.equal(c.call(impl.longest_cached_prefix, hashes, set(hashes), 10, 4), 8)


def test_the_last_token_is_always_prefilled(impl):
    hashes = block_hashes(list(range(8)), 4, SEED)
    c = Case("longest_cached_prefix(hashes, cached, n_tokens=8, block_size=4)",
             "a prompt of exactly 2 blocks, both cached", shapes="2 block hashes", lesson=LESSON + "#the-last-token",
             hint=RULE + ": the first output token comes from the logits of the last prompt token, so it is "
                         "recomputed: here 4 tokens are served, not 8")
    c.equal(c.call(impl.longest_cached_prefix, hashes, set(hashes), 8, 4), 4)
    c.equal(c.call(impl.longest_cached_prefix, hashes[:1], set(hashes), 4, 4), 0)


def test_agrees_with_minillms_prefix_cache(impl):
    model, B = tiny_model("llama_gqa"), 4
    system, a, b = prompt(8, seed=1)[0].tolist(), prompt(5, seed=2)[0].tolist(), prompt(3, seed=3)[0].tolist()
    pc = PrefixCache(model, block_size=B)
    cache = KVCache.for_model(model, max_seq_len=32)
    first = system + a
    with torch.no_grad():
        prefill(model, first, cache)
    pc.insert(model, first, cache)
    c = Case("longest_cached_prefix(block_hashes(ids, 4, model_seed(model)), prefix_cache, len(ids), 4)",
             "a PrefixCache holding the 3 blocks of an earlier 13-token prompt", shapes="block_size 4",
             hint=RULE + "; use block_hashes for the hashes, the PrefixCache answers `h in cache`",
             lesson=LESSON + "#longest-cached-prefix")
    for ids in (system + b, first, first + b, b + system):
        hashes = c.call(impl.block_hashes, ids, B, model_seed(model))
        got = c.call(impl.longest_cached_prefix, hashes, pc, len(ids), B)
        c.equal(got, pc.match(model, ids).cached_tokens)


# -- differential checks (issue 30): every length around the block boundaries, extra keys, any Container ----

REF = reference(EXERCISES["ex11"])


class OnlyContains:
    """A Container and nothing more (like a PrefixCache): ``h in cached``, no iteration, no set algebra."""

    def __init__(self, hashes):
        self._hashes = frozenset(hashes)

    def __contains__(self, h) -> bool:
        return h in self._hashes

    def __repr__(self) -> str:
        return f"a cache holding {sorted(h.hex()[:8] for h in self._hashes)}"


def blake2b_block(parent: bytes, tokens, extra_keys) -> bytes:
    """Another hash_fn (blake2b of the same fields): block_hashes must call the one it is given."""
    return hashlib.blake2b(parent + repr((list(tokens), list(extra_keys))).encode(), digest_size=32).digest()


def _lengths(block_size: int):
    """0, 1, and every length at a block boundary or one token off it."""
    boundary = [k * block_size + d for k in range(0, 5) for d in (-1, 0, 1)]
    return st.sampled_from(sorted({n for n in boundary + [0, 1] if n >= 0})) | st.integers(0, 6 * block_size + 3)


@given(data=st.data())
@CHECKS
def test_block_hashes_agree_with_the_reference(impl, data):
    block_size = data.draw(st.sampled_from([1, 2, 3, 4, 16]) | st.integers(1, 9), label="block_size")
    n = data.draw(_lengths(block_size), label="n_tokens")
    ids = data.draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n), label="token_ids")
    kind = data.draw(st.sampled_from([list, tuple]), label="token_ids as")
    seed = data.draw(st.sampled_from([SEED, bytes(32)]), label="seed")
    extra = data.draw(st.sampled_from([(), ("lora-1",), ("image", 3), ("salt-a", "lora-2")]), label="extra_keys")
    hash_fn = data.draw(st.sampled_from([hash_block, blake2b_block]), label="hash_fn")
    agree(impl.block_hashes, REF.block_hashes,
          lambda: ((kind(ids), block_size, seed), {"extra_keys": extra, "hash_fn": hash_fn}),
          what="block_hashes", exercise="ex11", lesson=LESSON + "#block-hashes",
          hint=CHAIN + "; a prompt of exactly k blocks has k hashes, one shorter than a block none; pass extra_keys "
                       "to every block's hash, through the hash_fn given; token_ids may be a list or a tuple")


@given(data=st.data())
@CHECKS
def test_longest_cached_prefix_agrees_with_the_reference(impl, data):
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]) | st.integers(1, 9), label="block_size")
    n_tokens = data.draw(_lengths(block_size), label="n_tokens")
    hashes = block_hashes(list(range(100, 100 + n_tokens)), block_size, SEED)
    hit = data.draw(st.lists(st.booleans(), min_size=len(hashes), max_size=len(hashes)) | st.just([True] * len(hashes)),
                    label="which blocks are cached")
    others = block_hashes(list(range(7, 7 + 3 * block_size)), block_size, SEED)  # another prompt's blocks
    cached = [h for h, yes in zip(hashes, hit) if yes] + others
    kind = data.draw(st.sampled_from([set, frozenset, OnlyContains]), label="cached as")
    hashes_kind = data.draw(st.sampled_from([list, tuple]), label="block_hashes as")
    agree(impl.longest_cached_prefix, REF.longest_cached_prefix,
          lambda: ((hashes_kind(hashes), kind(cached), n_tokens, block_size), {}),
          what="longest_cached_prefix", exercise="ex11", lesson=LESSON + "#longest-cached-prefix",
          hint=RULE + "; a prompt whose every block is cached still prefills its last token; `cached` is any "
                      "Container (a PrefixCache answers only `h in cached`)")
