"""Exercise 15: the block allocator: blocks per request, pool slots, reference counts, the free queue.

The oracles are hand-computed tables (a fresh pool hands out block 0, 1, 2, ... from the head of its
free queue) and one invariant: a block's ref_count is the number of block tables that hold it.
"""

from collections import Counter

import pytest

from exercises.checking import Case

pytestmark = pytest.mark.ex15
LESSON = "lessons/11-serving.md#paged-kv-cache"
CEIL = ("blocks = ceil(num_tokens / block_size) = (num_tokens + block_size - 1) // block_size: a partial last "
        "block still takes a whole block; 16 tokens fill exactly 1 block of 16, the 17th starts a 2nd")
SLOT = ("slot = block_table[p // B] * B + p % B, with p the position in the request (0 = its first prompt "
        "token), not in this chunk; a table of n blocks holds positions 0 .. n*B - 1")
ALLOCATE = ("the table needs ceil(num_tokens / block_size) blocks: the cached_blocks first (share_block each), "
            "then allocate_block() for each missing one; check there are enough free blocks BEFORE changing "
            "anything (a free cached hit leaves the free queue, so it is not a fresh block too)")
REFS = ("free_block: ref_count -= 1; only at 0 does the block join the END of the free queue (another request "
        "may still read a block whose count stays above 0); a count already at 0 is a double free: raise "
        "RuntimeError")
ORDER = ("free() walks the table last to first: the tail joins the free queue first and is evicted first, "
         "the head (a shared system prompt, the likeliest to be hit again) stays cached longest")
SHAPES = "num_blocks={n}, block_size={b}; block tables are lists of block ids"


def pool(impl, num_blocks, block_size=16, caching=False):
    return impl.BlockAllocator(num_blocks, block_size, enable_prefix_caching=caching)


def state(alloc):
    """Everything allocate_slots may change, as plain values (to compare before and after)."""
    return {"block_tables": {r: list(t) for r, t in alloc.block_tables.items()},
            "ref_counts": [b.ref_count for b in alloc.blocks], "free_queue": list(alloc.free_queue),
            "cached": dict(alloc.cached)}


def test_blocks_needed_by_hand(impl):
    for n, b, expected in [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (31, 16, 2), (32, 16, 2),
                           (33, 16, 3), (37, 16, 3), (5, 1, 5), (9, 4, 3)]:
        c = Case(f"blocks_needed({n}, block_size={b})", f"{n} tokens in blocks of {b}", shapes="-> a number of blocks",
                 hint=CEIL, lesson=LESSON)
        c.equal(c.call(impl.blocks_needed, n, b), expected)


def test_slot_mapping_by_hand(impl):
    for table, start, end, b, expected, case in [
        ([7, 2], 3, 6, 4, [31, 8, 9], "the docstring's example: positions 3, 4, 5 cross from block 7 into block 2"),
        ([3, 5], 15, 18, 16, [63, 80, 81], "positions 15, 16, 17: one before, exactly on and one after a boundary"),
        ([3, 5], 16, 17, 16, [80], "a decode at position 16: the first slot of the request's 2nd block"),
        ([3, 5], 0, 32, 16, list(range(48, 64)) + list(range(80, 96)), "a 32-token prefill filling both blocks"),
        ([3, 5], 20, 20, 16, [], "an empty range"),
    ]:
        c = Case(f"slot_mapping({table}, start={start}, end={end}, block_size={b})", case,
                 shapes=f"{end - start} positions -> {end - start} slots", hint=SLOT, lesson=LESSON)
        c.equal(c.call(impl.slot_mapping, table, start, end, b), expected)


def test_slot_mapping_beyond_the_table_raises(impl):
    c = Case("slot_mapping([3, 5], start=30, end=32, block_size=16)", "the last two positions of a full table",
             shapes="2 blocks of 16 hold positions 0..31", lesson=LESSON,
             hint=SLOT + ": end = 32 is allowed (position 31 is the last slot); end = 33 is beyond the table")
    c.equal(c.call(impl.slot_mapping, [3, 5], 30, 32, 16), [94, 95])
    c = Case("slot_mapping([3, 5], start=30, end=33, block_size=16)", "position 32 needs a 3rd block",
             shapes="2 blocks of 16 hold positions 0..31", lesson=LESSON,
             hint="the docstring promises a ValueError when a position falls beyond the table: allocate first")
    c.raises(ValueError, impl.slot_mapping, [3, 5], 30, 33, 16)


def test_allocate_slots_at_block_boundaries(impl):
    alloc = pool(impl, 8)
    c = Case("allocate_slots(request_id, num_tokens)", "a fresh pool: requests of 15, 16 and 17 tokens, then two "
             "grow by decodes (16 -> 17 tokens, 17 -> 32 -> 33)", shapes=SHAPES.format(n=8, b=16),
             hint=ALLOCATE + "; a fresh pool hands out blocks 0, 1, 2, ... (the head of its free queue)",
             lesson=LESSON)
    for rid, n in [("r15", 15), ("r16", 16), ("r17", 17), ("r16", 17), ("r17", 32), ("r17", 33)]:
        c.true(c.call(alloc.allocate_slots, rid, n) is True, f"allocate_slots({rid!r}, {n}) did not return True",
               expected=True, got=False)
    c.equal(state(alloc)["block_tables"], {"r15": [0], "r16": [1, 4], "r17": [2, 3, 5]})
    c.equal(state(alloc)["ref_counts"], [1, 1, 1, 1, 1, 1, 0, 0])
    c.equal(alloc.num_free_blocks, 2)


def test_allocate_slots_returns_false_and_changes_nothing(impl):
    alloc = pool(impl, 4)
    c = Case("allocate_slots(request_id, num_tokens, cached_blocks)", "a pool of 4 blocks, A holds 3 (33 tokens)",
             shapes=SHAPES.format(n=4, b=16), lesson=LESSON,
             hint=ALLOCATE + "; 'Nothing changes when it returns False': no table, no ref count, no free queue entry")
    c.call(alloc.allocate_slots, "A", 33)
    for rid, n, hits, what in [("B", 17, (), "B needs 2 blocks, 1 is free"),
                               ("A", 65, (), "A grows to 65 tokens: 2 more blocks, 1 is free"),
                               ("B", 80, (0, 1), "B shares A's blocks 0 and 1 and needs 3 fresh ones, 1 is free")]:
        before = state(alloc)
        got = c.call(alloc.allocate_slots, rid, n, hits)
        c.true(got is False, f"allocate_slots({rid!r}, {n}, {list(hits)}) returned {got!r}: {what}", False, got)
        c.equal(state(alloc), before, hint=f"{what}: it returned False, so the state must be as before; " + ALLOCATE)


def test_free_cached_hits_are_not_counted_twice(impl):
    alloc = pool(impl, 4)
    c = Case("allocate_slots('B', num_tokens, cached_blocks=[0, 1])",
             "A held blocks 0 and 1 and finished: all 4 blocks are free, 0 and 1 are B's prefix-cache hits",
             shapes=SHAPES.format(n=4, b=16), hint=ALLOCATE, lesson=LESSON)
    c.call(alloc.allocate_slots, "A", 32)
    c.call(alloc.free, "A")
    before = state(alloc)
    got = c.call(alloc.allocate_slots, "B", 80, [0, 1])
    c.true(got is False, "B needs 5 blocks: 2 hits + 3 fresh, but only 2 blocks besides the hits are free",
           expected=False, got=got)
    c.equal(state(alloc), before)
    c.true(c.call(alloc.allocate_slots, "B", 64, [0, 1]) is True, "2 hits + 2 fresh blocks fit the pool", True, False)
    c.equal(state(alloc)["block_tables"], {"B": [0, 1, 2, 3]}, hint=ALLOCATE + "; the hits come first in the table")
    c.equal(state(alloc)["ref_counts"], [1, 1, 1, 1])


def test_shared_blocks_are_freed_only_by_their_last_holder(impl):
    alloc = pool(impl, 6)
    c = Case("free('A')", "A holds [0, 1, 2]; B shares A's blocks 0 and 1 (prefix-cache hits) and holds 3",
             shapes=SHAPES.format(n=6, b=16), hint=REFS, lesson=LESSON)
    c.call(alloc.allocate_slots, "A", 40)
    c.call(alloc.allocate_slots, "B", 40, [0, 1])
    c.equal(state(alloc)["block_tables"], {"A": [0, 1, 2], "B": [0, 1, 3]},
            hint=ALLOCATE + "; the hits go at the start of B's table, shared, not copied")
    c.equal(state(alloc)["ref_counts"], [2, 2, 1, 1, 0, 0], hint="share_block adds 1 to each hit's ref_count")
    c.call(alloc.free, "A")
    c.equal(state(alloc)["ref_counts"], [1, 1, 0, 1, 0, 0], hint=REFS + ": B still holds blocks 0 and 1")
    c.equal(state(alloc)["free_queue"], [4, 5, 2], hint=REFS + ": only block 2 (ref_count 0) joins the free queue")
    got = c.call(alloc.allocate_slots, "C", 80)
    c.true(got is False, "C (5 blocks) was given blocks that B still reads: their K/V would be overwritten",
           expected=False, got=got, hint=REFS)
    c.call(alloc.free, "B")
    c.equal(state(alloc)["ref_counts"], [0] * 6)
    c.equal(state(alloc)["free_queue"], [4, 5, 2, 3, 1, 0], hint=REFS + "; " + ORDER)


def test_a_double_free_raises(impl):
    alloc = pool(impl, 4)
    c = Case("free_block(block_id)", "A held block 0 and freed it; then block 0 is freed again, and block 3 "
             "(never handed out) is freed", shapes=SHAPES.format(n=4, b=16), hint=REFS, lesson=LESSON)
    c.call(alloc.allocate_slots, "A", 10)
    c.call(alloc.free_block, 0)
    c.equal(state(alloc)["free_queue"], [1, 2, 3, 0])
    c.raises(RuntimeError, alloc.free_block, 0)
    c.raises(RuntimeError, alloc.free_block, 3)


def test_free_releases_the_tail_first(impl):
    alloc = pool(impl, 6, block_size=4, caching=True)
    a = list(range(100, 112))  # 3 full blocks of 4
    c = Case("free('A')", "X holds block 0, A holds [1, 2, 3] (its 3 blocks cached); X finishes, then A",
             shapes=SHAPES.format(n=6, b=4), hint=ORDER, lesson=LESSON)
    c.call(alloc.allocate_slots, "X", 4)
    c.call(alloc.allocate_slots, "A", 12)
    alloc.cache_full_blocks("A", a, 12)
    c.call(alloc.free, "X")
    c.call(alloc.free, "A")
    c.equal(state(alloc)["free_queue"], [4, 5, 0, 3, 2, 1])
    c = Case("find_cached_prefix(A's prompt + 1 token) after 4 fresh blocks were handed out",
             "the 4th fresh block evicts the least recently freed cached block: A's tail, not its head",
             shapes=SHAPES.format(n=6, b=4), hint=ORDER, lesson=LESSON)
    c.call(alloc.allocate_slots, "D", 16)
    c.equal(alloc.find_cached_prefix(a + [7]), [1, 2], hint=ORDER + ": blocks 1 and 2 should still be hits")


def test_every_ref_count_returns_to_zero(impl):
    alloc = pool(impl, 10, block_size=4, caching=True)
    system = [1, 2, 3, 4, 5, 6, 7, 8]  # 2 blocks every request shares
    prompts = {"A": system + [11, 12, 13], "B": system + [21, 22, 23, 24, 25], "C": system + [31],
               "D": system + [41, 42, 43, 44]}
    tokens = {}
    c = Case("allocate_slots / free", "", shapes=SHAPES.format(n=10, b=4) + "; ref_counts listed by block id 0..9",
             lesson=LESSON,
             hint=REFS + "; at any time a block's ref_count is the number of block tables holding it, the free "
                         "queue holds exactly the blocks at 0, and when every request has finished all are at 0")

    def start(rid):
        tokens[rid] = list(prompts[rid])
        hits = alloc.find_cached_prefix(tokens[rid])
        c.true(c.call(alloc.allocate_slots, rid, len(tokens[rid]), hits) is True, f"{rid} did not fit", True, False)
        alloc.cache_full_blocks(rid, tokens[rid], len(tokens[rid]))

    def decode(rid):
        tokens[rid].append(99)
        c.true(c.call(alloc.allocate_slots, rid, len(tokens[rid])) is True, f"{rid}'s decode did not fit", True, False)
        alloc.cache_full_blocks(rid, tokens[rid], len(tokens[rid]))

    ops = {"start": start, "decode": decode, "free": lambda rid: alloc.free(rid)}
    steps = [("start", "A"), ("start", "B"), ("start", "C"), ("decode", "A"), ("decode", "A"), ("decode", "C"),
             ("free", "B"), ("start", "D"), ("decode", "D"), ("free", "A"), ("decode", "C"), ("free", "D"),
             ("free", "C")]
    for i, (op, rid) in enumerate(steps):
        c.case = ("A, B, C, D share a 2-block system prompt; after " +
                  ", ".join(f"{o}({r})" for o, r in steps[:i + 1]))
        c.call(ops[op], rid)
        held = Counter(b for table in alloc.block_tables.values() for b in table)
        c.equal(state(alloc)["ref_counts"], [held[b] for b in range(10)])
        c.equal(sorted(alloc.free_queue), [b for b in range(10) if held[b] == 0])
    c.equal(alloc.num_free_blocks, 10)
