"""Exercise 16: one scheduler step: decodes first, the token budget, chunked prefill, FCFS, preemption.

No model runs: requests and a BlockAllocator are built by hand, and a step "runs" by adding each
scheduled count to num_computed_tokens (a request whose tokens are all computed gets one more
output token). The oracles are hand-computed step tables, and minillm's Scheduler on a seeded
workload.
"""

import random

import pytest

from exercises.checking import Case
from minillm.sampling import SamplingParams
from minillm.serving.block_allocator import BlockAllocator
from minillm.serving.request import RUNNING, WAITING, Request
from minillm.serving.scheduler import Scheduler

pytestmark = pytest.mark.ex16
LESSON = "lessons/11-serving.md#continuous-batching"
ORDER = ("running requests first: decodes (1 token left) before partial prefills, oldest first within each; "
         "then waiting requests in arrival order; every request gets min(tokens left, budget left)")
BUDGET = ("max_num_batched_tokens counts every token of the step, decodes included; a chunk takes what is LEFT "
          "of the budget after the requests before it")
NO_CHUNK = ("with enable_chunked_prefill off a prompt runs whole or not at all: if it does not fit the budget "
            "left it waits, and the requests behind it wait too (first come, first served: no overtaking)")
PREEMPT = ("when allocate_slots fails, preempt the NEWEST running request (running[-1], the one that lost the "
           "least work): free its blocks (allocator.free), num_computed_tokens = 0, status WAITING, at the FRONT "
           "of waiting, in batch.preempted; no new request starts in a step that preempted")
OUTPUT_TOKEN = 5


def new_request(rid, prompt_len, output_len=0, max_new_tokens=100):
    """A request with its own prompt ids (no two share a block, so no prefix-cache hits by accident)."""
    base = 1000 * (sum(map(ord, rid)) % 97 + 1)
    return Request(rid, list(range(base, base + prompt_len)), SamplingParams(max_new_tokens=max_new_tokens),
                   arrival_s=0.0, output_ids=[OUTPUT_TOKEN] * output_len)


def setup(impl, num_blocks=128, block_size=16, caching=False, **knobs):
    return impl.Scheduler(BlockAllocator(num_blocks, block_size, enable_prefix_caching=caching), **knobs)


def run(sched, rid, prompt_len, output_len=0, computed=None, max_new_tokens=100):
    """A request already running, its first ``computed`` tokens in the cache (default: all but the last: a decode)."""
    r = new_request(rid, prompt_len, output_len, max_new_tokens)
    r.status, r.num_computed_tokens = RUNNING, r.num_tokens - 1 if computed is None else computed
    assert sched.allocator.allocate_slots(rid, r.num_computed_tokens), "the check's pool is too small"
    sched.running.append(r)
    return r


def wait(sched, rid, prompt_len, max_new_tokens=100):
    r = new_request(rid, prompt_len, max_new_tokens=max_new_tokens)
    sched.add(r)
    return r


def decision(batch):
    return [(r.request_id, n) for r, n in zip(batch.requests, batch.num_tokens)]


def ids(requests):
    return [r.request_id for r in requests]


def step(c, sched):
    """Schedule, then 'run' the batch."""
    return apply(sched, c.call(sched.schedule))


def apply(sched, batch):
    """'Run' a batch: computed += n; a request at its end gets a token (and may finish)."""
    for r, n in zip(batch.requests, batch.num_tokens):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_ids.append(OUTPUT_TOKEN)
            if len(r.output_ids) >= r.params.max_new_tokens:
                sched.finish(r, "length")
    return batch


def test_decodes_are_not_starved_by_a_prefill(impl):
    sched = setup(impl, max_num_batched_tokens=512)
    run(sched, "C", 900, computed=100)  # the oldest: a long prompt, 800 tokens still to prefill
    run(sched, "A", 20, output_len=3)
    run(sched, "B", 30, output_len=1)
    c = Case("scheduler.schedule()", "running C (oldest, 800 prompt tokens left), A and B (decodes); budget 512",
             shapes="decision as [(request_id, num_tokens), ...] in batch order", hint=ORDER, lesson=LESSON)
    c.equal(decision(c.call(sched.schedule)), [("A", 1), ("B", 1), ("C", 510)],
            hint=ORDER + ": a long prompt's chunk must not push the decodes out of the step (their users are waiting "
                         "for the next token: that is what chunked prefill is for)")


def test_the_docstrings_step(impl):
    sched = setup(impl, max_num_batched_tokens=512)
    run(sched, "A", 20, output_len=3)
    run(sched, "B", 30, output_len=1)
    run(sched, "C", 900, computed=600)
    D = wait(sched, "D", 700)
    wait(sched, "E", 40)
    c = Case("scheduler.schedule()", "the module docstring's step: A, B decode, C has 300 prompt tokens left, "
             "D (700) and E (40) wait; budget 512, chunked prefill on",
             shapes="decision as [(request_id, num_tokens), ...] in batch order", hint=ORDER + "; " + BUDGET,
             lesson=LESSON)
    batch = c.call(sched.schedule)
    c.true(batch.total_tokens <= 512, "the step exceeds max_num_batched_tokens = 512", expected="<= 512",
           got=f"{batch.total_tokens}: {decision(batch)}", hint=BUDGET)
    c.equal(decision(batch), [("A", 1), ("B", 1), ("C", 300), ("D", 210)])
    c.equal((ids(sched.running), ids(sched.waiting)), (["A", "B", "C", "D"], ["E"]),
            hint="a started request joins the END of running and leaves waiting; E still waits (budget used up)")
    c.equal((D.status, D.num_computed_tokens), (RUNNING, 0),
            hint="a started request is RUNNING; num_computed_tokens is what is in the cache BEFORE this step: 0")


def test_a_chunk_is_cut_to_the_remaining_budget(impl):
    sched = setup(impl, max_num_batched_tokens=64)
    run(sched, "d1", 10, output_len=1)
    run(sched, "d2", 12, output_len=2)
    wait(sched, "P", 100)
    c = Case("scheduler.schedule(), 3 steps", "budget 64, d1 and d2 decoding, P (a 100-token prompt) waiting; "
             "chunked prefill on", shapes="decisions as [(request_id, num_tokens), ...] per step",
             hint=BUDGET + ": 64 - 2 decodes = 62 tokens of P, then the other 38 (after the decodes), then P decodes",
             lesson=LESSON)
    got = [decision(step(c, sched)) for _ in range(3)]
    c.equal(got, [[("d1", 1), ("d2", 1), ("P", 62)], [("d1", 1), ("d2", 1), ("P", 38)],
                  [("d1", 1), ("d2", 1), ("P", 1)]])


def test_without_chunked_prefill_a_prompt_waits_for_room(impl):
    sched = setup(impl, max_num_batched_tokens=64, enable_chunked_prefill=False)
    run(sched, "d1", 10, output_len=1, max_new_tokens=2)  # finishes after this step
    run(sched, "d2", 12, output_len=2)
    wait(sched, "P", 63)
    wait(sched, "Q", 10)
    c = Case("scheduler.schedule(), 3 steps", "budget 64, chunked prefill OFF; d1 (finishing after step 1) and d2 "
             "decode; P (63 tokens) then Q (10 tokens) wait", shapes="decisions as [(request_id, num_tokens), ...]",
             hint=NO_CHUNK + ": step 1 leaves 62 < 63, so P and Q wait; step 2 leaves 63: P runs whole; step 3: "
                             "P decodes and Q's 10 tokens fit", lesson=LESSON)
    got = [decision(step(c, sched)) for _ in range(3)]
    c.equal(got, [[("d1", 1), ("d2", 1)], [("d2", 1), ("P", 63)], [("d2", 1), ("P", 1), ("Q", 10)]])


def test_waiting_requests_start_first_come_first_served(impl):
    sched = setup(impl, max_num_batched_tokens=64)
    for rid, n in [("A", 30), ("B", 20), ("C", 30)]:
        wait(sched, rid, n)
    c = Case("scheduler.schedule()", "A (30 tokens), B (20), C (30) arrived in this order; budget 64, chunking on",
             shapes="decision as [(request_id, num_tokens), ...]", lesson=LESSON,
             hint="waiting requests start first come, first served (waiting[0] first, a deque's popleft); "
                  "the last one gets what is left of the budget, 14 tokens")
    c.equal(decision(c.call(sched.schedule)), [("A", 30), ("B", 20), ("C", 14)])
    c.equal(ids(sched.running), ["A", "B", "C"])


def test_max_num_seqs_caps_the_batch(impl):
    sched = setup(impl, max_num_batched_tokens=512, max_num_seqs=2)
    wait(sched, "A", 10, max_new_tokens=2)
    wait(sched, "B", 10)
    wait(sched, "C", 10)
    c = Case("scheduler.schedule(), 3 steps", "max_num_seqs 2: A (finishing after 2 tokens), B and C wait, "
             "the budget (512) has room for all", shapes="decisions as [(request_id, num_tokens), ...] per step",
             lesson=LESSON, hint="max_num_seqs caps the running requests (len(running)): C starts only once A "
                                 "has finished")
    got = [decision(step(c, sched)) for _ in range(3)]
    c.equal(got, [[("A", 10), ("B", 10)], [("A", 1), ("B", 1)], [("B", 1), ("C", 10)]])


def test_preemption_takes_the_newest_request(impl):
    sched = setup(impl, num_blocks=6, block_size=4, max_num_batched_tokens=64)
    run(sched, "A", 8, output_len=1, computed=8, max_new_tokens=2)  # 2 full blocks; its decode needs a 3rd
    run(sched, "B", 8, output_len=1, computed=8)  # the same
    C = run(sched, "C", 4, output_len=1, computed=4)  # the newest: 1 full block; its decode needs a 2nd
    wait(sched, "W", 4)
    c = Case("scheduler.schedule()", "a pool of 6 blocks of 4; A, B, C (newest) decode and each needs a new block; "
             "1 block is free; W waits", shapes="decision as [(request_id, num_tokens), ...]", hint=PREEMPT,
             lesson=LESSON)
    batch = c.call(sched.schedule)
    c.equal((decision(batch), ids(batch.preempted)), ([("A", 1), ("B", 1)], ["C"]),
            hint=PREEMPT + ": A takes the free block, B finds none, so C (the newest) is preempted")
    c.equal("C" in sched.allocator.block_tables, False, hint=PREEMPT + ": C's blocks go back to the pool")
    c.equal(sched.allocator.num_free_blocks, 0, hint=PREEMPT + ": C's block went to B")
    c.equal((ids(sched.running), ids(sched.waiting)), (["A", "B"], ["C", "W"]),
            hint=PREEMPT + "; W does not start in this step")
    c.equal((C.status, C.num_computed_tokens, C.num_preemptions), (WAITING, 0, 1), hint=PREEMPT)

    c = Case("scheduler.schedule(), the next step", "after the step above A finishes (its 2nd token): C is "
             "recomputed (its prompt AND its output token), then W", shapes="decision as [(request_id, num_tokens)]",
             hint="a preempted request starts again from 0: it prefills prompt + output so far (4 + 1 = 5 tokens)",
             lesson=LESSON)
    apply(sched, batch)  # A gets its 2nd and last token and finishes: its 3 blocks are free again
    c.equal(decision(c.call(sched.schedule)), [("B", 1), ("C", 5), ("W", 4)])


def test_prefix_hits_are_not_recomputed(impl):
    sched = setup(impl, num_blocks=16, block_size=16, caching=True, max_num_batched_tokens=512)
    A = run(sched, "A", 40, output_len=1)
    sched.allocator.cache_full_blocks("A", A.all_token_ids, A.num_computed_tokens)
    B = new_request("B", 10)
    B.prompt_ids = A.prompt_ids[:32] + B.prompt_ids  # A's first 2 blocks, then 10 tokens of its own
    sched.add(B)
    c = Case("scheduler.schedule()", "A (running) computed 40 tokens; B's 42-token prompt starts with A's first "
             "32 (2 cached blocks of 16)", shapes="decision as [(request_id, num_tokens)]", lesson=LESSON,
             hint="take the hits: hits = allocator.find_cached_prefix(tokens); computed = len(hits) * block_size; "
                  "schedule only num_tokens - computed and pass hits to allocate_slots")
    c.equal(decision(c.call(sched.schedule)), [("A", 1), ("B", 10)])
    c.equal((B.num_computed_tokens, B.num_cached_tokens), (32, 32))
    c.equal(sched.allocator.block_tables["B"][:2], sched.allocator.block_tables["A"][:2])


def workload(seed):
    """Arrival step, prompt length and max_new_tokens of 12 requests."""
    rng = random.Random(seed)
    return [(rng.randrange(0, 12), rng.randrange(1, 50), rng.randrange(1, 12)) for _ in range(12)]


def test_a_workload_step_by_step_as_minillm(impl):
    for seed, knobs in [(0, dict(max_num_batched_tokens=48, max_num_seqs=4)),
                        (1, dict(max_num_batched_tokens=64, max_num_seqs=8, enable_chunked_prefill=False)),
                        (2, dict(max_num_batched_tokens=32, max_num_seqs=3))]:
        c = Case("scheduler.schedule(), step after step", f"12 requests arriving over 12 steps (seed {seed}), a pool "
                 f"of 18 blocks of 4 (preemptions happen), {knobs}; the oracle is minillm's Scheduler",
                 shapes="decision as [(request_id, num_tokens), ...], preempted ids", lesson=LESSON,
                 hint=ORDER + "; " + BUDGET + "; " + PREEMPT)
        reqs = workload(seed)
        yours, oracle = setup(impl, 18, 4, **knobs), Scheduler(BlockAllocator(18, 4, enable_prefix_caching=False),
                                                               **knobs)
        for t in range(300):
            for sched in (yours, oracle):
                for i, (arrive, n, max_new) in enumerate(reqs):
                    if arrive == t:
                        wait(sched, f"r{i}", n, max_new_tokens=max_new)
            queues = f"running {ids(oracle.running)}, waiting {ids(oracle.waiting)}"
            expected = step(c, oracle)
            got = step(c, yours)
            c.true(got.total_tokens <= knobs["max_num_batched_tokens"], f"step {t} exceeds the budget",
                   expected=f"<= {knobs['max_num_batched_tokens']}", got=decision(got), hint=BUDGET)
            c.true(len(got.requests) <= knobs["max_num_seqs"], f"step {t} exceeds max_num_seqs",
                   expected=f"<= {knobs['max_num_seqs']}", got=decision(got))
            mine, theirs = (decision(got), ids(got.preempted)), (decision(expected), ids(expected.preempted))
            c.true(mine == theirs, f"step {t} differs from minillm's (before it: {queues})", theirs, mine)
            if t > 12 and not oracle.has_unfinished():
                break
        c.equal((ids(yours.running), ids(yours.waiting), yours.allocator.num_free_blocks), ([], [], 18),
                hint="every request finished: nothing running or waiting, every block back in the pool")
