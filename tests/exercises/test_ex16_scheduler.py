"""Exercise 16: one scheduler step: decodes first, the token budget, chunked prefill, FCFS, preemption.

No model runs: requests and a BlockAllocator are built by hand, and a step "runs" by adding each
scheduled count to num_computed_tokens (a request whose tokens are all computed gets one more
output token). The oracles are hand-computed step tables, and minillm's Scheduler on a seeded
workload.
"""

import random
import time

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from exercises.checking import Case
from exercises.differential import CHECKS
from minillm.sampling import SamplingParams
from minillm.serving.block_allocator import BlockAllocator
from minillm.serving.request import RUNNING, WAITING, Request
from minillm.serving.scheduler import ScheduledBatch, Scheduler

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


def test_a_preempted_request_leaves_the_batch(impl):
    sched = setup(impl, num_blocks=3, block_size=4, max_num_batched_tokens=64)
    run(sched, "O", 12, computed=4)  # the older: 8 prompt tokens left, holds 1 block, needs 2 more
    N = run(sched, "N", 4, output_len=1, computed=4)  # the newest: a decode, holds 1 block, needs a 2nd
    c = Case("scheduler.schedule()", "a pool of 3 blocks of 4: O (older, 8 prompt tokens left) and N (newest, a "
             "decode); N is scheduled first (decodes first) and takes the free block, then O finds none",
             shapes="decision as [(request_id, num_tokens)], preempted ids", lesson=LESSON,
             hint=PREEMPT + "; the newest is N, already in this step's batch: take it back OUT of the batch (its "
                            "blocks are freed, it has nowhere to write its K/V)")
    batch = c.call(sched.schedule)
    c.equal((decision(batch), ids(batch.preempted)), ([("O", 8)], ["N"]))
    c.equal((N.status, N.num_computed_tokens, len(N.preempted_s)), (WAITING, 0, 1), hint=PREEMPT + "; append "
            "time.perf_counter() to preempted_s")


def test_prefix_hits_are_taken_without_chunked_prefill_too(impl):
    sched = setup(impl, num_blocks=16, block_size=16, caching=True, max_num_batched_tokens=64,
                  enable_chunked_prefill=False)
    A = run(sched, "A", 40, output_len=1)
    sched.allocator.cache_full_blocks("A", A.all_token_ids, A.num_computed_tokens)
    B = new_request("B", 10)
    B.prompt_ids = A.prompt_ids[:32] + B.prompt_ids
    sched.add(B)
    c = Case("scheduler.schedule()", "chunked prefill OFF; A (running) computed 40 tokens; B's 42-token prompt "
             "starts with A's first 32 (2 cached blocks of 16)", shapes="decision as [(request_id, num_tokens)]",
             lesson=LESSON, hint="prefix-cache hits are taken whether chunked prefill is on or off: only the "
                                 "num_tokens - computed tokens after them run, and they must fit the budget left")
    c.equal(decision(c.call(sched.schedule)), [("A", 1), ("B", 10)])
    c.equal((B.num_computed_tokens, B.num_cached_tokens), (32, 32))


def test_a_recompute_longer_than_the_budget_does_not_wait_forever(impl):
    sched = setup(impl, num_blocks=16, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    P = new_request("P", 6, output_len=4)  # preempted after 4 output tokens: 10 tokens to recompute, budget 8
    P.num_preemptions, P.first_scheduled_s = 1, 0.0
    sched.add(P)
    wait(sched, "Q", 4)
    c = Case("scheduler.schedule(), 2 steps", "chunked prefill OFF, budget 8; P (6 prompt + 4 output tokens, "
             "preempted: 10 tokens to recompute) then Q (4) wait; nothing runs",
             shapes="decisions as [(request_id, num_tokens), ...] per step", lesson=LESSON,
             hint="P is longer than max_num_batched_tokens itself: no step could ever run it whole, so it is cut "
                  "to the budget left as if chunking were on (waiting for room would wait forever, and Q behind it)")
    got = [decision(step(c, sched)) for _ in range(2)]
    c.equal(got, [[("P", 8)], [("P", 2), ("Q", 4)]])


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


# -- a stateful check (issue 30): the student's scheduler against minillm's, side by side ---------------------

# A rule-based state machine per example. Shrinking a sequence of steps costs a class 10-20 s: instead, short
# sequences first (a failure found there is a short story to read), then longer ones.
STATEFUL = [settings(CHECKS, max_examples=40, stateful_step_count=12, phases=[Phase.explicit, Phase.generate]),
            settings(CHECKS, max_examples=20, stateful_step_count=30, phases=[Phase.explicit, Phase.generate])]
SYSTEM_PROMPT = [1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 0]  # requests share its first tokens: prefix-cache hits
HINTS = {
    "batch": ORDER + "; " + BUDGET,
    "preempted": PREEMPT,
    "finished": "schedule ends no request in these checks (every request fits the pool on its own)",
    "running": "a started request joins the END of running; a preempted one leaves it",
    "waiting": "waiting is first come, first served; a preempted request goes back to its FRONT (appendleft)",
    "requests": "a started request: status RUNNING, num_computed_tokens = its prefix-cache hits' tokens; on its "
                "first start only: first_scheduled_s and num_cached_tokens; a preempted one: WAITING, "
                "num_computed_tokens 0, num_preemptions + 1, a time appended to preempted_s",
    "blocks": "each scheduled request needs allocate_slots(request_id, num_computed_tokens + n[, hits]) before it "
              "runs; a preempted request's blocks are freed (allocator.free)",
}


def request_state(r):
    return (r.status, r.num_computed_tokens, r.num_cached_tokens, r.num_preemptions, len(r.preempted_s),
            r.first_scheduled_s is not None, len(r.output_ids), r.finish_reason)


REQUEST_FIELDS = ("status, num_computed_tokens, num_cached_tokens, num_preemptions, len(preempted_s), "
                  "first_scheduled_s set, len(output_ids), finish_reason")


def scheduler_state(sched, requests):
    a = sched.allocator
    return {"running": ids(sched.running), "waiting": ids(sched.waiting),
            "requests": {rid: request_state(r) for rid, r in requests.items()},
            "blocks": {"block_tables": {r: list(t) for r, t in a.block_tables.items()},
                       "ref_counts": [b.ref_count for b in a.blocks], "free_queue": list(a.free_queue)}}


class SchedulerAgainstMinillm(RuleBasedStateMachine):
    """Random traffic through the student's scheduler and minillm's, side by side.

    Requests arrive (sharing a system prompt's first tokens, so prefix-cache hits happen), steps are
    scheduled and 'run' (computed += n; a request at its end gets a token, and finishes at max_new_tokens),
    waiting and running requests are aborted, and the knobs change between steps (budget, chunked prefill
    on and off). A small pool forces preemptions. After every operation the batch, the queues, every
    request's fields and the pool must be minillm's, and the student's step must keep the invariants.
    """

    def __init__(self, impl):
        super().__init__()
        self.impl, self.log = impl, []

    @initialize(num_blocks=st.integers(2, 8), block_size=st.integers(1, 4), max_num_seqs=st.sampled_from([3, 2, 4, 1]),
                budget_blocks=st.integers(1, 4), extra=st.integers(0, 3), chunked=st.sampled_from([True, False]),
                caching=st.sampled_from([True, True, False]))
    def make_schedulers(self, num_blocks, block_size, max_num_seqs, budget_blocks, extra, chunked, caching):
        knobs = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget_blocks * block_size + extra,
                     enable_chunked_prefill=chunked)
        self.ref = Scheduler(BlockAllocator(num_blocks, block_size, enable_prefix_caching=caching), **knobs)
        self.yours = self.impl.Scheduler(BlockAllocator(num_blocks, block_size, enable_prefix_caching=caching),
                                         **knobs)
        self.capacity, self.block_size = num_blocks * block_size, block_size
        self.shapes = (f"a pool of {num_blocks} blocks of {block_size}, prefix caching "
                       f"{'on' if caching else 'off'}, first knobs {knobs}; decisions as [(request_id, num_tokens)]")
        self.requests = {"ref": {}, "yours": {}}
        self.stamps = {}  # request id -> the student's first_scheduled_s, once set
        self.next_id = 0

    def case(self, hint):
        return Case("Scheduler.schedule(), operation after operation", "after " + "; ".join(self.log), hint=hint,
                    shapes=self.shapes, lesson=LESSON)

    def agree(self):
        mine = scheduler_state(self.yours, self.requests["yours"])
        theirs = scheduler_state(self.ref, self.requests["ref"])
        for key in theirs:
            if mine[key] != theirs[key]:
                what = f"{key} differ from minillm's" + (f" ({REQUEST_FIELDS})" if key == "requests" else "")
                self.case(HINTS[key]).fail(what, theirs[key], mine[key])

    def _new_request(self, shared, own, max_new_tokens, chunked_ok=False):
        """A request id and its prompt (a system prompt's first tokens, then its own), fitting the pool alone."""
        self.next_id += 1
        rid = f"r{self.next_id}"
        prompt = (SYSTEM_PROMPT[:shared] + [(7 * self.next_id + i) % 3 for i in range(own)]) or [0]
        chunked = chunked_ok or self.ref.enable_chunked_prefill
        limit = self.capacity if chunked else self.ref.max_num_batched_tokens  # as the engine admits prompts
        prompt = prompt[:max(1, min(limit, self.capacity - max_new_tokens + 1))]
        return rid, prompt, min(max_new_tokens, self.capacity - len(prompt) + 1)

    @rule(shared=st.sampled_from([len(SYSTEM_PROMPT), 6]) | st.integers(0, len(SYSTEM_PROMPT)),
          own=st.integers(0, 6), max_new_tokens=st.integers(1, 10), then_steps=st.integers(0, 2))
    def a_request_arrives(self, shared, own, max_new_tokens, then_steps):
        rid, prompt, max_new_tokens = self._new_request(shared, own, max_new_tokens)
        for side, sched in (("ref", self.ref), ("yours", self.yours)):
            r = Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new_tokens), arrival_s=0.0)
            self.requests[side][rid] = r
            sched.add(r)
        self.log.append(f"{rid} arrives ({len(prompt)}-token prompt, the first {min(shared, len(prompt))} shared; "
                        f"max_new_tokens {max_new_tokens})")
        for _ in range(then_steps):
            self.step()

    @rule(lefts=st.lists(st.just(1) | st.integers(2, 12), min_size=1, max_size=2), own=st.integers(2, 12),
          max_new_tokens=st.integers(1, 6))
    def requests_are_already_running(self, lefts, own, max_new_tokens):
        """Running requests set up by hand, as the checks above do: each prompt computed up to any point (an
        older one may still be prefilling while a newer one decodes)."""
        for left in lefts:
            rid, prompt, max_new = self._new_request(0, own, max_new_tokens, chunked_ok=True)
            computed = max(0, len(prompt) - left)
            if (self.ref.allocator.num_free_blocks < -(-computed // self.block_size)
                    or len(self.ref.running) >= self.ref.max_num_seqs):
                return
            for side, sched in (("ref", self.ref), ("yours", self.yours)):
                r = Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new), arrival_s=0.0)
                r.status, r.num_computed_tokens = RUNNING, computed
                assert sched.allocator.allocate_slots(rid, computed)
                self.requests[side][rid] = r
                sched.running.append(r)
            self.log.append(f"{rid} is running, set up by hand: {computed} of its {len(prompt)} prompt tokens "
                            f"computed (max_new_tokens {max_new})")

    @rule(steps=st.integers(1, 3))
    def steps(self, steps):
        for _ in range(steps):
            self.step()

    def step(self):
        ref, yours = self.ref, self.yours
        before = f"running {ids(ref.running)}, waiting {ids(ref.waiting)}"
        waiting_before, idle = ids(yours.waiting), not yours.running
        self.log.append(f"schedule() [{before}; budget {ref.max_num_batched_tokens}, chunked prefill "
                        f"{'on' if ref.enable_chunked_prefill else 'off'}]")
        expected = ref.schedule()
        c = self.case(ORDER)
        t0 = time.perf_counter()
        got = c.call(yours.schedule)
        t1 = time.perf_counter()
        if not isinstance(got, ScheduledBatch):
            c.fail(f"returned a {type(got).__name__}, not a ScheduledBatch")
        self.check_the_step(got, waiting_before, idle, t0, t1)
        mine = {"batch": decision(got), "preempted": ids(got.preempted), "finished": ids(got.finished)}
        theirs = {"batch": decision(expected), "preempted": ids(expected.preempted),
                  "finished": ids(expected.finished)}
        for key in theirs:
            if mine[key] != theirs[key]:
                self.case(HINTS[key]).fail(f"the step's {key} differs from minillm's", theirs[key], mine[key])
        self.agree()
        self.log[-1] += f" -> {decision(expected)}" + (f", preempted {ids(expected.preempted)}"
                                                      if expected.preempted else "")
        for sched, batch in ((ref, expected), (yours, got)):
            for r, n in zip(batch.requests, batch.num_tokens):
                r.num_computed_tokens += n
                sched.allocator.cache_full_blocks(r.request_id, r.all_token_ids, r.num_computed_tokens)
                if r.num_computed_tokens == r.num_tokens:
                    r.output_ids.append(len(r.output_ids) % 2)
                    if len(r.output_ids) >= r.params.max_new_tokens:
                        sched.finish(r, "length")
        self.agree()

    def check_the_step(self, batch, waiting_before, idle, t0, t1):
        """What a step must keep whatever minillm does (a clearer message than a difference)."""
        sched, c = self.yours, self.case(ORDER)
        c.true(batch.total_tokens <= sched.max_num_batched_tokens, "the step exceeds max_num_batched_tokens",
               f"<= {sched.max_num_batched_tokens}", decision(batch), hint=BUDGET)
        c.true(len(sched.running) <= sched.max_num_seqs, "more requests run than max_num_seqs",
               f"<= {sched.max_num_seqs}", ids(sched.running), hint="max_num_seqs caps len(running)")
        for r, n in zip(batch.requests, batch.num_tokens):
            table = sched.allocator.block_tables.get(r.request_id, [])
            if r.status != RUNNING or r in sched.waiting or len(table) * self.block_size < r.num_computed_tokens + n:
                c.fail(f"{r.request_id} is in the step's batch ({n} tokens) but it is {r.status} with a block table "
                       f"of {len(table)} blocks of {self.block_size}: it has nowhere to write its K/V", hint=PREEMPT
                       + "; a request preempted after it was scheduled in this step comes back OUT of the batch")
        for r in batch.preempted:
            c.true(r.status == WAITING and r in sched.waiting and r.request_id not in sched.allocator.block_tables,
                   f"{r.request_id} was preempted but is {r.status}, with blocks: "
                   f"{sched.allocator.block_tables.get(r.request_id)}", hint=PREEMPT)
        started = [r.request_id for r in batch.requests if r.request_id in waiting_before]
        c.true(started == waiting_before[:len(started)], "waiting requests did not start first come, first served",
               waiting_before[:len(started)], started, hint=NO_CHUNK)
        if idle and waiting_before:
            c.true(bool(batch.requests), "nothing ran: requests wait, nothing is running, the whole pool is free",
                   "a request starts", decision(batch),
                   hint="every step with a budget of at least one block must make progress; with chunked prefill "
                        "off, a request longer than max_num_batched_tokens itself (a preempted one whose prompt + "
                        "output outgrew it) is cut to the budget, or it would wait forever")
        for rid, r in self.requests["yours"].items():
            if r.first_scheduled_s is None:
                continue
            first = self.stamps.setdefault(rid, r.first_scheduled_s)
            if r.first_scheduled_s != first:
                c.fail(f"{rid}'s first_scheduled_s changed from {first} to {r.first_scheduled_s}",
                       hint="first_scheduled_s is set on a request's FIRST start only (a restart after a "
                            "preemption keeps it, and its num_cached_tokens)")
            if rid in started and r.num_preemptions == 0 and not t0 <= first <= t1:
                c.fail(f"{rid} started in this step but its first_scheduled_s {first} is not a time.perf_counter() "
                       f"taken during the step ({t0:.6f} .. {t1:.6f})")

    @precondition(lambda self: self.ref.waiting or self.ref.running)
    @rule(data=st.data())
    def abort_a_request(self, data):
        """A waiting or a running request is aborted (minillm's finish: its blocks go back to the pool)."""
        rid = data.draw(st.sampled_from(ids(self.ref.waiting) + ids(self.ref.running)), label="request")
        self._abort(rid)

    def _abort(self, rid):
        self.log.append(f"abort {rid}")
        for side, sched in (("ref", self.ref), ("yours", self.yours)):
            sched.finish(self.requests[side][rid], "abort")
        self.agree()

    @rule(budget_blocks=st.integers(1, 4), extra=st.integers(0, 3), chunked=st.booleans())
    def change_the_knobs(self, budget_blocks, extra, chunked):
        budget = budget_blocks * self.block_size + extra
        self.log.append(f"max_num_batched_tokens = {budget}, enable_chunked_prefill = {chunked}, then a step")
        for sched in (self.ref, self.yours):
            sched.max_num_batched_tokens, sched.enable_chunked_prefill = budget, chunked
        self.step()


def test_random_traffic_step_by_step_as_minillm(impl):
    for stage in STATEFUL:
        run_state_machine_as_test(lambda: SchedulerAgainstMinillm(impl), settings=stage)
