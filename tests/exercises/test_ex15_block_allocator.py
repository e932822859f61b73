"""Exercise 15: the block allocator: blocks per request, pool slots, reference counts, the free queue.

The oracles are hand-computed tables (a fresh pool hands out block 0, 1, 2, ... from the head of its
free queue) and one invariant: a block's ref_count is the number of block tables that hold it.
"""

from collections import Counter

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from exercises.checking import Case
from exercises.differential import CHECKS, agree
from exercises.registry import EXERCISES, reference

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


# -- differential and stateful checks (issue 30): the student's code against minillm's, side by side ---------

REF = reference(EXERCISES["ex15"])
# A rule-based state machine per example: fewer examples than a function check, each a sequence of operations.
# Shrinking a sequence costs a class 10-20 s: instead, short sequences first (a failure found there is a short
# story to read), then longer ones.
STATEFUL = [settings(CHECKS, max_examples=30, stateful_step_count=10, phases=[Phase.explicit, Phase.generate]),
            settings(CHECKS, max_examples=12, stateful_step_count=30, phases=[Phase.explicit, Phase.generate])]
FUNCTION = settings(CHECKS, max_examples=30)  # the meta-test runs every check against ~20 mistakes


@given(data=st.data())
@FUNCTION
def test_blocks_needed_agrees_with_the_reference(impl, data):
    block_size = data.draw(st.integers(1, 20) | st.sampled_from([16, 32, 256, 4096]), label="block_size")
    full = data.draw(st.integers(0, 6) | st.integers(0, 10**9 // block_size), label="full blocks")
    num_tokens = max(0, full * block_size + data.draw(st.sampled_from([-1, 0, 1]) | st.integers(0, block_size - 1),
                                                      label="tokens past them"))
    agree(impl.blocks_needed, REF.blocks_needed, lambda: ((num_tokens, block_size), {}), what="blocks_needed",
          exercise="ex15", lesson=LESSON, hint=CEIL + "; an int, however large (positions far from 0 too)")


@given(data=st.data())
@FUNCTION
def test_slot_mapping_agrees_with_the_reference(impl, data):
    block_size = data.draw(st.integers(1, 16), label="block_size")
    table = data.draw(st.lists(st.integers(0, 200), max_size=6, unique=True), label="block_table")
    kind = data.draw(st.sampled_from([list, tuple]), label="the Sequence kind")
    capacity = len(table) * block_size
    if data.draw(st.booleans(), label="a position beyond the table"):  # the promised ValueError
        end = data.draw(st.integers(capacity + 1, capacity + 2 * block_size), label="end")
        start = data.draw(st.sampled_from([0, capacity, end - 1]) | st.integers(0, end - 1), label="start")
    else:
        end = data.draw(st.sampled_from([0, capacity]) | st.integers(0, capacity), label="end")
        start = data.draw(st.sampled_from([0, end, max(0, end - 1)]) | st.integers(0, end), label="start")
    agree(impl.slot_mapping, REF.slot_mapping, lambda: ((kind(table), start, end, block_size), {}),
          what="slot_mapping", exercise="ex15", lesson=LESSON,
          hint=SLOT + "; a position at or past len(block_table) * block_size raises ValueError (allocate first); "
                      "block_table is any Sequence (a list or a tuple); the answer is a list of ints")


def snapshot(alloc):
    """The allocator's observable state, as plain values (block hashes shortened to 8 hex digits)."""
    short = lambda h: None if h is None else h.hex()[:8]  # noqa: E731
    return {"block_tables": {r: list(t) for r, t in alloc.block_tables.items()},
            "ref_counts": [b.ref_count for b in alloc.blocks],
            "free_queue": list(alloc.free_queue),
            "block_hashes": [short(b.block_hash) for b in alloc.blocks],
            "cached": {short(h): b for h, b in alloc.cached.items()},
            "requests with hashes": sorted(alloc._hashes)}


STATE_HINTS = {
    "block_tables": ALLOCATE,
    "ref_counts": REFS + "; a prefix-cache hit is taken with share_block (ref_count + 1, out of the free queue)",
    "free_queue": REFS + "; " + ORDER + "; a hit on a free cached block takes it OUT of the free queue (share_block)",
    "block_hashes": "a block keeps its hash while free (a later request can still hit it) until allocate_block "
                    "hands it out again; hits must be shared with share_block, not copied",
    "cached": "the prefix-cache map changes only through the inherited allocate_block and cache_full_blocks",
    "requests with hashes": "free also forgets the request's block hashes: self._hashes.pop(request_id, None) "
                            "(a preempted request starts again under the same id and names its blocks anew)",
}


def invariant_problem(alloc):
    """What is inconsistent inside one allocator (no reference needed), or None."""
    holders = Counter(b for table in alloc.block_tables.values() for b in table)
    for rid, table in alloc.block_tables.items():
        twice = [b for b, n in Counter(table).items() if n > 1]
        if twice:
            return (f"block {twice[0]} appears twice in {rid}'s table {table}: two positions of one request would "
                    "write the same K/V slots")
    for block in alloc.blocks:
        if block.block_id in alloc.free_queue and block.ref_count > 0:
            return (f"block {block.block_id} has ref_count {block.ref_count} but is still in the free queue: the "
                    "next allocate_block hands it to another request, and two requests write the same K/V")
        if block.ref_count != holders[block.block_id]:
            return (f"block {block.block_id} has ref_count {block.ref_count} but {holders[block.block_id]} block "
                    "table(s) hold it: a reference count is the number of holders")
        if block.ref_count == 0 and block.block_id not in alloc.free_queue:
            return f"block {block.block_id} has ref_count 0 but is not in the free queue: it is lost to the pool"
    return None


SYSTEM_PROMPT = [1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 0]  # requests share its first tokens: prefix-cache hits


class AllocatorAgainstMinillm(RuleBasedStateMachine):
    """Random requests over a small pool, run on the student's allocator and on minillm's side by side.

    Requests start (with the prefix-cache hits find_cached_prefix gives them), grow by prefill chunks and
    decodes, and are freed (finished, preempted: they may start again under the same id, or aborted while
    waiting: no blocks to free); a double free must raise. After every operation the two allocators must
    be in the same state, and the student's must be consistent on its own.
    """

    def __init__(self, impl):
        super().__init__()
        self.impl, self.log = impl, []

    @initialize(num_blocks=st.integers(1, 8), block_size=st.integers(1, 4), caching=st.sampled_from([True, False]))
    def make_pool(self, num_blocks, block_size, caching):
        kwargs = dict(seed=b"ex15", enable_prefix_caching=caching)
        self.ref = REF.BlockAllocator(num_blocks, block_size, **kwargs)
        self.yours = self.impl.BlockAllocator(num_blocks, block_size, **kwargs)
        self.block_size = block_size
        self.shapes = f"BlockAllocator(num_blocks={num_blocks}, block_size={block_size}, " \
                      f"enable_prefix_caching={caching}); tokens from a 2-token alphabet, so prefixes repeat"
        self.tokens, self.computed = {}, {}  # requests holding blocks: their tokens, positions computed
        self.stopped = {}  # requests without blocks (waiting, preempted, finished): their tokens
        self.next_id = 0

    def case(self, hint):
        return Case("BlockAllocator, operation after operation", "after " + "; ".join(self.log), hint=hint,
                    shapes=self.shapes, lesson=LESSON)

    def agree(self, hint):
        problem = invariant_problem(self.yours)
        if problem:
            self.case(hint).fail(problem, detail=f"your state: {snapshot(self.yours)}")
        mine, theirs = snapshot(self.yours), snapshot(self.ref)
        for key in theirs:
            if mine[key] != theirs[key]:
                self.case(STATE_HINTS[key]).fail(f"{key} differ from minillm's", theirs[key], mine[key])

    def both(self, method, *args, hint):
        """Call ``method`` on both allocators; the student's answer must be the reference's, of the same type."""
        expected = getattr(self.ref, method)(*args)
        c = self.case(hint)
        got = c.call(getattr(self.yours, method), *args)
        c.equal(got, expected)
        return expected

    def _start(self, rid, tokens, chunk, as_tuple):
        hits = self.ref.find_cached_prefix(tokens)
        computed = len(hits) * self.block_size
        end = min(len(tokens), computed + chunk)
        kind = tuple if as_tuple else list
        self.log.append(f"allocate_slots({rid!r}, {end}, cached_blocks={kind(hits)!r})  [{len(tokens)}-token prompt]")
        expected = self.ref.allocate_slots(rid, end, kind(hits))
        c = self.case(ALLOCATE)
        argument = kind(hits)
        got = c.call(self.yours.allocate_slots, rid, end, argument)
        c.equal(got, expected)
        c.equal(argument, kind(hits), hint="allocate_slots must leave the caller's cached_blocks as they were")
        if expected:
            self.tokens[rid], self.computed[rid] = list(tokens), end
            for alloc in (self.ref, self.yours):
                alloc.cache_full_blocks(rid, tokens, end)
        else:
            self.stopped[rid] = list(tokens)
        self.agree(ALLOCATE)

    @rule(shared=st.integers(0, len(SYSTEM_PROMPT)), own=st.lists(st.integers(0, 1), max_size=6),
          chunk=st.integers(1, 12), as_tuple=st.booleans())
    def start_a_request(self, shared, own, chunk, as_tuple):
        """A new request: the first ``shared`` tokens of a common system prompt, then its own."""
        self.next_id += 1
        self._start(f"r{self.next_id}", (SYSTEM_PROMPT[:shared] + own) or [0], chunk, as_tuple)

    @precondition(lambda self: self.stopped)
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def start_it_again(self, data, chunk):
        """A preempted (or still waiting) request starts again under its id, prompt + output recomputed."""
        rid = data.draw(st.sampled_from(sorted(self.stopped)), label="request")
        self._start(rid, self.stopped.pop(rid), chunk, False)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 1), max_size=2), chunk=st.integers(1, 8))
    def grow(self, data, new_tokens, chunk):
        """The next prefill chunk, or a decode after output tokens were appended."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="request")
        self.tokens[rid] += new_tokens
        end = min(len(self.tokens[rid]), self.computed[rid] + chunk)
        self.log.append(f"allocate_slots({rid!r}, {end})")
        if self.both("allocate_slots", rid, end, hint=ALLOCATE + "; a request that already holds blocks keeps "
                     "them and gets only the missing ones"):
            self.computed[rid] = end
            for alloc in (self.ref, self.yours):
                alloc.cache_full_blocks(rid, self.tokens[rid], end)
        self.agree(ALLOCATE)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_a_request(self, data):
        """It finished, was aborted while running, or was preempted (then it may start again)."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)), label="request")
        self.log.append(f"free({rid!r})")
        self.both("free", rid, hint=REFS + "; " + ORDER)
        self.stopped[rid] = self.tokens.pop(rid)
        del self.computed[rid]
        self.agree(REFS + "; " + ORDER)

    @rule(data=st.data(), double_free=st.booleans())
    def free_what_nobody_holds(self, data, double_free):
        """Abort a request that holds no blocks (still waiting, or freed already): nothing to release, no error.
        Or free_block a block whose ref_count is 0 already: a double free, RuntimeError."""
        free = [b.block_id for b in self.ref.blocks if b.ref_count == 0]
        if double_free and free:
            block_id = data.draw(st.sampled_from(free), label="block")
            self.log.append(f"free_block({block_id})  [no table holds it]")
            try:
                self.ref.free_block(block_id)
                raise RuntimeError("minillm's free_block did not raise")  # pragma: no cover
            except RuntimeError:
                pass
            self.case(REFS).raises(RuntimeError, self.yours.free_block, block_id)
            self.agree(REFS + "; a double free that raises must change nothing")
            return
        rid = data.draw(st.sampled_from(sorted(self.stopped) + ["never-started"]), label="request")
        self.log.append(f"free({rid!r})  [it holds no blocks]")
        self.both("free", rid, hint="the docstring: a request that holds no blocks (aborted while still waiting) "
                                    "has nothing to release, no error: block_tables.pop(request_id, [])")
        self.agree(REFS)


def test_random_operations_agree_with_minillm(impl):
    for stage in STATEFUL:
        run_state_machine_as_test(lambda: AllocatorAgainstMinillm(impl), settings=stage)
