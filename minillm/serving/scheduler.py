"""The scheduler: which requests run in the next step, and how many tokens each.

Iteration-level ("continuous") batching (Orca, Yu et al. 2022; vLLM): the batch is built
anew every step, so a request joins the moment there is room and leaves the moment it
finishes, instead of a batch waiting for its slowest member. One step, under a budget of
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences::

    running (oldest first):  A decode 1 | B decode 1 | C prefill, 300 of 900 left
    waiting (FCFS):          D prompt 700 | E prompt 40
    budget 512:              A 1, B 1, C 300 (its last chunk), D 210 (a first chunk) -> 512

1. Running requests first: decodes (1 token each), then partly prefilled prompts (their
   next chunk), oldest first. Decodes are never starved by a long prompt.
   A decode that writes into a block another sequence also holds (parallel sampling: the
   n sequences of a request share the prompt's last, partial block after the fork) first
   gets a copy of that block (copy on write, :meth:`BlockAllocator.copy_on_write`).
2. If a running request needs a block and none is free, the newest running request is
   *preempted*: its blocks are freed and it goes back to the front of the waiting queue,
   to be recomputed (prompt + output so far) when there is room again.
3. Then waiting requests, first come first served: their prefix-cache hits are taken
   (for a request that wants its prompt's logprobs, none before the positions whose logits
   they need: cached K/V holds no logits, so those positions are computed again, as vLLM does),
   and their prompt (or, with chunked prefill, as much as the budget has left) is scheduled.
   With KV tiers (``offload``, :mod:`minillm.serving.kv_tiers`), the hash chain goes on past the
   pool's hits through host memory and disk; the blocks it loads there (cheaper than a prefill,
   by the cost model) are copied into the request's fresh blocks and count as cached too.

Chunked prefill (Sarathi-Serve, Agrawal et al. 2024) is step 3 cutting a long prompt into
budget-sized chunks across steps: the decodes of step 1 then never wait behind a
2,000-token prefill, which is what removes the inter-token latency spikes. Without it, a
prompt that does not fit the remaining budget waits for the next step, and so do the requests
behind it; only a request longer than the whole budget (a preempted one whose prompt + output
outgrew it) is cut into chunks even so: no step could ever run it whole.

:meth:`Scheduler.schedule` is the decision only (no model runs): it can be printed and
tested on its own. :meth:`Scheduler.update` applies the tokens the model produced.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import check_positive_int
from .block_allocator import BlockAllocator
from .request import FINISHED, RUNNING, WAITING, Request


@dataclass
class ScheduledBatch:
    """One step's decision.

    Attributes:
        requests: the scheduled requests, running ones first, in order.
        num_tokens: tokens of each request computed this step (1 for a decode).
        preempted: requests that lost their blocks this step (now waiting again).
        finished: requests ended by the scheduler itself (the pool cannot hold them).
    """

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for r, n in zip(self.requests, self.num_tokens) if is_decode(r, n))

    @property
    def num_prefill_tokens(self) -> int:
        return self.total_tokens - self.num_decode_tokens

    def rows(self) -> tuple[tuple[str, int, int], ...]:
        """(request_id, num_prefill_tokens, num_decode_tokens) per scheduled request (before the step runs)."""
        return tuple((r.request_id, 0, n) if is_decode(r, n) else (r.request_id, n, 0)
                     for r, n in zip(self.requests, self.num_tokens))

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __repr__(self) -> str:
        parts = [f"{r.request_id}:{'decode' if is_decode(r, n) else 'prefill'} {n}"
                 for r, n in zip(self.requests, self.num_tokens)]
        extra = f", preempted {[r.request_id for r in self.preempted]}" if self.preempted else ""
        return f"ScheduledBatch([{', '.join(parts)}], {self.total_tokens} tokens{extra})"


def is_decode(request: Request, num_tokens: int) -> bool:
    """A decode computes one output token's K/V; anything else (prompt tokens, or a recompute
    of prompt + output after a preemption) is prefill. Call it before the step runs."""
    return num_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens


class Scheduler:
    """Waiting and running queues, and the policy that builds each step's batch.

    Args:
        allocator: the paged cache's :class:`BlockAllocator`.
        max_num_seqs: most requests in one batch (vLLM's ``max_num_seqs``).
        max_num_batched_tokens: most tokens computed in one step, prefill and decode
            together (vLLM's ``max_num_batched_tokens``); at least one block.
        enable_chunked_prefill: split prompts across steps to fit the budget (vLLM's
            ``enable_chunked_prefill``). Off: a prompt runs whole, so it must fit the budget.

    The knobs are plain attributes: change them between steps to watch their effect.
    ``offload``: the engine's :class:`~minillm.serving.kv_tiers.KVOffload`, or None (the pool alone).
    Raises ValueError for a non-positive limit or a token budget below ``block_size``.
    """

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True):
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_num_batched_tokens < allocator.block_size:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than one block "
                             f"({allocator.block_size} tokens); raise it to at least {allocator.block_size}")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.offload = None

    def add(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue (first come, first served)."""
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while a request is waiting or running."""
        return bool(self.waiting or self.running)

    # -- the decision -----------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Build the next step's batch (see the module docstring); allocates the blocks it needs."""
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        decodes_first = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)  # stable
        for request in decodes_first:
            if budget == 0:
                break
            if request.status != RUNNING:  # preempted earlier in this loop
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, n, batch):
                continue
            batch.requests.append(request)
            batch.num_tokens.append(n)
            budget -= n
        if not batch.preempted:  # no room was short: new requests may start
            self._admit_waiting(batch, budget)
        return batch

    def _make_room(self, request: Request, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for ``n`` more tokens of a running request, preempting the newest ones if needed.
        False when the request itself was preempted (or finished: the pool cannot hold it alone)."""
        while not (self.allocator.allocate_slots(request.request_id, request.num_computed_tokens + n)
                   and self.allocator.copy_on_write(request.request_id, request.num_computed_tokens)):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                self._finish_pool_full(request, batch)
                return False
            self._preempt(victim, batch)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """FCFS: start waiting requests while the budget, the sequence limit and the pool allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if len(self.running) + request.num_forks >= self.max_num_seqs:
                break  # n > 1: its n sequences will run side by side after the prefill
            hits = self.allocator.find_cached_prefix(request.all_token_ids, request.cache_salt)
            max_hits = (request.num_tokens - 1) // self.allocator.block_size  # the last token is computed
            if (logits_from := request.prompt_logits_from) is not None:  # prompt logprobs: only hits before the
                max_hits = min(max_hits, logits_from // self.allocator.block_size)  # positions whose logits
            hits = hits[:max_hits]                                                  # are still needed
            loads = self._tier_hits(request, len(hits), max_hits)
            computed = (len(hits) + len(loads.blocks if loads else ())) * self.allocator.block_size
            n = request.num_tokens - computed
            if n > budget and not self.enable_chunked_prefill and n <= self.max_num_batched_tokens:
                break  # the whole prompt must run in one step: wait for a step with room
            # (a recompute after preemption longer than any step is chunked even so: it could never run)
            n = min(n, budget)
            if not self.allocator.allocate_slots(request.request_id, computed + n, hits):
                break  # the pool is full: wait for running requests to free blocks
            if loads:  # into the fresh blocks after the pool's hits
                self.offload.place(loads, self.allocator.block_tables[request.request_id][len(hits):])
            self.waiting.popleft()
            request.status, request.num_computed_tokens = RUNNING, computed
            if request.first_scheduled_s is None:
                request.first_scheduled_s = time.perf_counter()
                request.num_cached_tokens = computed
            self.running.append(request)
            batch.requests.append(request)
            batch.num_tokens.append(n)
            budget -= n

    def _tier_hits(self, request: Request, num_pool_hits: int, max_hits: int):
        """The request's blocks after its pool hits found in the KV tiers and read (not yet placed), or None."""
        if self.offload is None or num_pool_hits >= max_hits:
            return None
        return self.offload.find(request.request_id, request.all_token_ids, request.cache_salt, num_pool_hits,
                                 max_hits)

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        """Free a running request's blocks and put it back at the front of the queue (recompute)."""
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.status, request.num_computed_tokens = WAITING, 0
        request.num_preemptions += 1
        request.preempted_s.append(time.perf_counter())
        self.waiting.appendleft(request)
        if request in batch.requests:  # scheduled earlier in this step: take it back out
            i = batch.requests.index(request)
            del batch.requests[i], batch.num_tokens[i]
        batch.preempted.append(request)

    def _finish_pool_full(self, request: Request, batch: ScheduledBatch) -> None:
        total = self.allocator.num_blocks * self.allocator.block_size
        self.finish(request, "length", message=f"the KV cache pool is full: {self.allocator.num_blocks} blocks "
                    f"({total} positions) cannot hold {request.num_tokens + 1} tokens; give the engine more "
                    "KV cache memory")
        batch.finished.append(request)

    # -- after the model ran ----------------------------------------------------------

    def finish(self, request: Request, reason: str, stop_reason=None, message: str | None = None) -> None:
        """End a request (any state): its blocks go back to the pool at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.allocator.free(request.request_id)
        request.status, request.finish_reason, request.stop_reason = FINISHED, reason, stop_reason
        request.message = message
        request.finish_s = time.perf_counter()

    def __repr__(self) -> str:
        return (f"Scheduler(waiting={[r.request_id for r in self.waiting]}, "
                f"running={[r.request_id for r in self.running]}, max_num_seqs={self.max_num_seqs}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}, "
                f"enable_chunked_prefill={self.enable_chunked_prefill})")
