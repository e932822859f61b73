"""The block allocator's invariants under random use (hypothesis), and its hand-computed cases.

The state machine admits requests (prefix-cache lookup, then a first chunk), grows them
(more computed tokens, as prefill chunks and decodes do), and frees them (finish, abort,
preemption), over a small pool so that allocation fails and cached blocks get evicted.
A shadow copy of the pool's *contents* (which token prefix each slot holds) catches a
block handed to two owners, a prefix hit on the wrong block, or a referenced block evicted.
"""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm.serving.block_allocator import BlockAllocator, blocks_needed, slot_mapping
from minillm.serving.paged_cache import PagedKVCache

NUM_BLOCKS, BLOCK_SIZE = 8, 2
# A two-token alphabet: prompts share prefixes often, so prefix hits are common.
tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=9)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, seed=b"test")
        self.tokens: dict[str, list[int]] = {}  # request id -> its tokens
        self.computed: dict[str, int] = {}  # request id -> positions written
        self.slots: dict[int, tuple] = {}  # flat slot -> the token prefix whose last K/V it holds
        self.next_id = 0

    def _snapshot(self):
        a = self.a
        return ([(b.ref_count, b.block_hash) for b in a.blocks], list(a.free_queue), dict(a.cached),
                {r: list(t) for r, t in a.block_tables.items()})

    def _compute(self, rid: str, end: int) -> None:
        """Write positions computed..end (what a forward pass does), then name the full blocks."""
        table, toks = self.a.block_tables[rid], self.tokens[rid]
        for p, slot in zip(range(self.computed[rid], end), slot_mapping(table, self.computed[rid], end, BLOCK_SIZE)):
            self.slots[slot] = tuple(toks[: p + 1])
        self.computed[rid] = end
        self.a.cache_full_blocks(rid, toks, end)

    @rule(tokens=tokens_st, chunk=st.integers(1, 9))
    def admit(self, tokens, chunk):
        rid = f"r{self.next_id}"
        self.next_id += 1
        hits = self.a.find_cached_prefix(tokens)
        assert len(hits) <= (len(tokens) - 1) // BLOCK_SIZE
        computed = len(hits) * BLOCK_SIZE
        end = min(len(tokens), computed + chunk)
        before = self._snapshot()
        if not self.a.allocate_slots(rid, end, hits):
            assert self._snapshot() == before, "a failed allocate_slots changed the allocator"
            return
        self.tokens[rid], self.computed[rid] = list(tokens), computed
        self._check_contents(rid)  # the hit blocks hold exactly this prompt's prefix
        self._compute(rid, end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 1), max_size=3), chunk=st.integers(1, 9))
    def grow(self, data, new_tokens, chunk):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.tokens[rid] += new_tokens  # outputs appended (a decode), or none (the next prefill chunk)
        end = min(len(self.tokens[rid]), self.computed[rid] + chunk)
        before = self._snapshot()
        if not self.a.allocate_slots(rid, end):
            assert self._snapshot() == before, "a failed allocate_slots changed the allocator"
            return
        assert len(self.a.block_tables[rid]) == blocks_needed(end, BLOCK_SIZE)
        self._compute(rid, end)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.a.free(rid)
        del self.tokens[rid], self.computed[rid]
        assert rid not in self.a.block_tables

    def _check_contents(self, rid):
        table = self.a.block_tables[rid]
        for p, slot in enumerate(slot_mapping(table, 0, self.computed[rid], BLOCK_SIZE)):
            assert self.slots.get(slot) == tuple(self.tokens[rid][: p + 1]), f"{rid} position {p}: wrong K/V"

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for rid in self.tokens:
            self._check_contents(rid)

    @invariant()
    def reference_counts_match_the_tables(self):
        a = self.a
        for table in a.block_tables.values():
            assert len(set(table)) == len(table), f"a block twice in one table: {table}"
        for block in a.blocks:
            holders = sum(block.block_id in table for table in a.block_tables.values())
            assert block.ref_count == holders, f"block {block.block_id}: ref_count {block.ref_count}, in {holders}"
        assert set(a.free_queue) == {b.block_id for b in a.blocks if b.ref_count == 0}
        assert a.num_free_blocks + a.num_used_blocks == NUM_BLOCKS

    @invariant()
    def cached_blocks_are_consistent_and_never_evicted_while_held(self):
        a = self.a
        for h, block_id in a.cached.items():
            assert a.blocks[block_id].block_hash == h
        for block in a.blocks:  # a held block with a hash is still the cached one: never evicted while held
            if block.block_hash is not None:
                assert a.cached[block.block_hash] == block.block_id

    def teardown(self):
        for rid in list(self.tokens):  # every request finishes or is aborted
            self.a.free(rid)
        assert all(b.ref_count == 0 for b in self.a.blocks)
        assert self.a.num_free_blocks == NUM_BLOCKS and not self.a.block_tables


AllocatorMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestAllocator = AllocatorMachine.TestCase


# -- hand-computed cases -------------------------------------------------------------


def test_slot_mapping_of_the_docstring():
    assert slot_mapping([7, 2], 3, 6, 4) == [31, 8, 9]
    with pytest.raises(ValueError, match="beyond the block table"):
        slot_mapping([7, 2], 0, 9, 4)


@pytest.mark.parametrize("n, expected", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed(n, expected):
    assert blocks_needed(n, 4) == expected


@pytest.mark.parametrize("length", [4, 5, 8, 9, 12, 13])
def test_a_prompt_hits_at_most_len_minus_1_positions(length):
    a = BlockAllocator(16, 4)
    tokens = list(range(length))
    assert a.allocate_slots("a", length)
    a.cache_full_blocks("a", tokens, length)
    assert len(a.find_cached_prefix(tokens)) * 4 == (length - 1) // 4 * 4  # the last token is always computed
    assert a.find_cached_prefix(tokens + [99]) == a.block_tables["a"][: length // 4]


def test_no_prefix_caching_means_no_hits_and_no_hashes():
    a = BlockAllocator(4, 2, enable_prefix_caching=False)
    assert a.allocate_slots("a", 5)
    a.cache_full_blocks("a", [1, 2, 3, 4, 5], 5)
    assert a.find_cached_prefix([1, 2, 3, 4, 5]) == [] and a.num_cached_blocks == 0


def test_lru_evicts_the_least_recently_freed_and_a_tail_before_its_head():
    a = BlockAllocator(4, 2)
    assert a.allocate_slots("a", 6)  # blocks [0, 1, 2], all full
    a.cache_full_blocks("a", [1, 2, 3, 4, 5, 6], 6)
    a.free("a")  # freed tail first: free queue [3 (never used), 2, 1, 0]
    assert list(a.free_queue) == [3, 2, 1, 0]
    assert a.allocate_slots("b", 4)  # takes 3 (no hash), then evicts 2 (a's tail)
    assert a.block_tables["b"] == [3, 2] and a.blocks[2].block_hash is None
    assert a.find_cached_prefix([1, 2, 3, 4, 5, 6, 7]) == [0, 1]  # a's head is still cached


def test_double_free_and_empty_pool_are_errors():
    a = BlockAllocator(1, 2)
    block = a.allocate_block()
    with pytest.raises(RuntimeError, match="no free KV cache block"):
        a.allocate_block()
    a.free_block(block.block_id)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free_block(block.block_id)


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (2.5, 4), (True, 4)])
def test_bad_pool_sizes_are_value_errors(num_blocks, block_size):
    with pytest.raises(ValueError, match="must be a positive int"):
        BlockAllocator(num_blocks, block_size)


@pytest.mark.parametrize("dtype, dtype_bytes", [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)])
def test_pool_bytes_match_the_formula(dtype, dtype_bytes):
    n_layers, n_kv_heads, head_dim, num_blocks, block_size = 3, 2, 8, 5, 4
    cache = PagedKVCache(n_layers, n_kv_heads, head_dim, num_blocks, block_size, dtype=dtype)
    expected = 2 * n_layers * n_kv_heads * block_size * head_dim * dtype_bytes * num_blocks
    assert cache.bytes_capacity == expected == cache.k.nbytes + cache.v.nbytes
    assert cache.bytes_used == 0
    cache.allocator.allocate_slots("a", 5)  # 2 blocks held
    assert cache.bytes_used == 2 * expected // num_blocks


def test_fork_shares_every_block_and_copy_on_write_copies_the_written_one():
    cache = PagedKVCache(2, 1, 2, 8, 4)
    a = cache.allocator
    assert a.allocate_slots("p", 6)  # [0, 1]: a full block and a partial one (2 of 4 positions)
    cache.k[:, 1] = 7.0
    a.fork("p", "c")
    assert a.block_tables["c"] == [0, 1] and [b.ref_count for b in a.blocks[:2]] == [2, 2]
    assert a.copy_on_write("c", 6)  # c writes position 6, in the shared partial block: its own copy
    assert a.block_tables["c"] == [0, 2] and [b.ref_count for b in a.blocks[:3]] == [2, 1, 1]
    assert a.pending_copies == [(1, 2)] and cache.copy_pending() == 1 and a.pending_copies == []
    assert torch.equal(cache.k[:, 2], cache.k[:, 1]) and torch.equal(cache.v[:, 2], cache.v[:, 1])
    assert a.copy_on_write("p", 6) and a.block_tables["p"] == [0, 1]  # the last holder writes in place
    assert a.copy_on_write("p", 8) and not a.pending_copies  # beyond the table: nothing shared
    a.free("p")
    a.free("c")
    assert a.num_free_blocks == 8


def test_copy_on_write_without_a_free_block_changes_nothing():
    a = BlockAllocator(2, 4)
    assert a.allocate_slots("p", 6)
    a.fork("p", "c")
    assert not a.copy_on_write("c", 6)
    assert a.block_tables["c"] == [0, 1] and a.blocks[1].ref_count == 2 and not a.pending_copies
