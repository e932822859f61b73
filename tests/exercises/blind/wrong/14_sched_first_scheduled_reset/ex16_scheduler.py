"""Exercise 16: one scheduler step of continuous batching: who runs next, and how many tokens each.

Write ``Scheduler.schedule``. The class inherits minillm's: ``self.running`` (a list, oldest
first), ``self.waiting`` (a deque, first come first), ``self.allocator`` (a :class:`BlockAllocator`),
the knobs ``max_num_batched_tokens``, ``max_num_seqs``, ``enable_chunked_prefill``, and
``finish``. Return a :class:`ScheduledBatch` (``requests``, ``num_tokens``, ``preempted``)::

    running (oldest first):  A decode 1 | B decode 1 | C prefill, 300 of 900 left
    waiting (FCFS):          D prompt 700 | E prompt 40
    budget 512:              A 1, B 1, C 300 (its last chunk), D 210 (a first chunk) -> 512

1. Running requests: decodes (1 token left: ``num_tokens - num_computed_tokens == 1``) first, then
   partly prefilled prompts, each group oldest first; each gets ``min(tokens left, budget left)``
   (stop when the budget is spent; skip a request preempted earlier in this loop). Each needs
   blocks for ``num_computed_tokens + n`` positions: ``self.allocator.allocate_slots``.
2. When that returns False, preempt the NEWEST running request (``self.running[-1]``, maybe the
   request itself) and try again: remove it from ``running``, free its blocks
   (``self.allocator.free``), set ``status = WAITING``, ``num_computed_tokens = 0``, add 1 to
   ``num_preemptions``, append ``time.perf_counter()`` to ``preempted_s``, put it at the FRONT of
   ``waiting``, take it out of the batch if it was scheduled earlier in this step, and append it
   to ``batch.preempted``.
3. Then, only if nobody was preempted, waiting requests in arrival order while the budget and
   ``max_num_seqs`` (running requests in all) allow: take the prefix-cache hits
   (``hits = self.allocator.find_cached_prefix(request.all_token_ids)``, ``computed = len(hits) *
   block_size``, chunked prefill on or off), schedule ``n = num_tokens - computed`` tokens, cut to
   the budget left when chunked prefill is on. When it is off, a prompt that does not fit the
   budget left waits, and so does everyone behind it; but an ``n`` above ``max_num_batched_tokens``
   itself (a preempted request whose prompt + output outgrew the budget) could never fit any step:
   it is cut to the budget left as if chunking were on, or it would wait forever.
   ``allocate_slots(request_id, computed + n, hits)`` False: stop, the pool is full. A started
   request: ``status = RUNNING``, ``num_computed_tokens = computed``, on its first start only
   ``first_scheduled_s`` (``time.perf_counter()``) and ``num_cached_tokens = computed``; it joins
   the end of ``running``.

Write it from the queues and the allocator: the inherited helpers ``_make_room``,
``_admit_waiting`` and ``_preempt`` are minillm's answer, split up. One case the checks leave out:
minillm ends the only running request when the whole pool cannot hold it (``_finish_pool_full``).
The checks build requests and a BlockAllocator by hand, no model: a step "runs" by adding each
scheduled count to ``num_computed_tokens``.

Check:      minillm check ex16   (or: pytest tests/exercises -m ex16 --impl student)
Lesson:     lessons/11-serving.md#continuous-batching
Reference:  minillm.serving.scheduler.Scheduler
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import time  # noqa: F401

from minillm.serving import scheduler
from minillm.serving.request import RUNNING, WAITING, Request  # noqa: F401
from minillm.serving.scheduler import ScheduledBatch


class Scheduler(scheduler.Scheduler):
    """minillm's Scheduler (queues, knobs, add, finish); schedule is yours."""

    def schedule(self) -> ScheduledBatch:
        """Build the next step's batch (see the module docstring); allocates the blocks it needs."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted_any = False

        def preempt(victim):
            self.running.remove(victim)
            self.allocator.free(victim.request_id)
            victim.status = WAITING
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            victim.preempted_s.append(time.perf_counter())
            self.waiting.appendleft(victim)
            if victim in batch.requests:
                i = batch.requests.index(victim)
                del batch.requests[i]
                del batch.num_tokens[i]
            batch.preempted.append(victim)

        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        others = [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        for request in decodes + others:
            if budget <= 0:
                break
            if request not in self.running:
                continue
            left = request.num_tokens - request.num_computed_tokens
            if left <= 0:
                continue
            n = min(left, budget)
            while True:
                if self.allocator.allocate_slots(request.request_id, request.num_computed_tokens + n):
                    batch.requests.append(request)
                    batch.num_tokens.append(n)
                    budget -= n
                    break
                victim = self.running[-1]
                preempt(victim)
                preempted_any = True
                if victim is request:
                    break

        if not preempted_any:
            block_size = self.allocator.block_size
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                hits = self.allocator.find_cached_prefix(request.all_token_ids)
                computed = len(hits) * block_size
                n = request.num_tokens - computed
                if self.enable_chunked_prefill:
                    n = min(n, budget)
                elif n > budget:
                    if n > self.max_num_batched_tokens:
                        n = budget
                    else:
                        break
                if not self.allocator.allocate_slots(request.request_id, computed + n, hits):
                    break
                self.waiting.popleft()
                request.status = RUNNING
                request.num_computed_tokens = computed
                request.first_scheduled_s = time.perf_counter()
                request.num_cached_tokens = computed
                self.running.append(request)
                batch.requests.append(request)
                batch.num_tokens.append(n)
                budget -= n
        return batch
