"""The step trace: what every engine step did, kept so that a run can be replayed and drawn.

One :class:`StepRecord` per :meth:`LLMEngine.step`: the batch (which requests, how many
prefill and decode tokens each), the wall time of the step, the pool's blocks after it,
and who was preempted or finished. With the requests' own timestamps (arrival, first
scheduled, each token, finish) this is everything a timeline needs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One engine step.

    Attributes:
        step: 0, 1, 2, ...
        start_s, end_s: ``time.perf_counter()`` around the step: scheduling, the forward
            pass, sampling and bookkeeping (seconds).
        scheduled: (request_id, num_prefill_tokens, num_decode_tokens) per request in the batch.
        num_blocks_used, num_blocks_free, num_blocks_cached: the pool after the step
            (a cached block with no owner counts as free and cached).
        preempted: ids of requests that lost their blocks this step.
        finished: ids of requests that finished this step.
        num_waiting, num_running: queue lengths after the step.
        num_kv_tokens: positions whose K/V the running requests hold after the step (a block
            shared by two requests counts for both): what a perfectly packed cache would store.
    """

    step: int
    start_s: float
    end_s: float
    scheduled: tuple[tuple[str, int, int], ...]
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()
    num_waiting: int = 0
    num_running: int = 0
    num_kv_tokens: int = 0

    @property
    def time_ms(self) -> float:
        return (self.end_s - self.start_s) * 1e3

    @property
    def num_prefill_tokens(self) -> int:
        return sum(p for _, p, _ in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(d for _, _, d in self.scheduled)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens
