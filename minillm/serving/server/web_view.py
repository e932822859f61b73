"""The live web view of a serving engine: its state as JSON, and the page that draws it.

``minillm serve`` serves it next to the OpenAI endpoints (routes/web.py)::

    GET /               the page (minillm/serving/server/web/index.html, one file, no CDN)
    GET /engine/state   engine_state(engine) as JSON, polled by the page a few times a second

    browser ──GET /engine/state──> routes/web.py ──(under async_engine.lock)──> engine_state(engine)
            <────── JSON: pool, latest step, queues, running and finished requests ───────┘

:func:`engine_state` is a pure read of the engine, so a notebook can print it too. What the
page shows is the same state a student printed in notebook 10: the block pool one square per
block (free, cached and reusable, or held by a request; a shared prefix block is held by
several), the latest step's batch (prefill chunk or decode per request), and the queues.
"""

import heapq
import time
from importlib import resources

from ..run_metrics import request_metrics
from ..step_trace import StepRecord

MAX_FINISHED = 20  # finished requests listed, newest first: a projector's table, not a log
MAX_BLOCKS = 4096  # blocks drawn one by one; the counts always cover the whole pool

FREE, CACHED, USED = "free", "cached", "used"


def engine_state(engine, max_blocks: int = MAX_BLOCKS, max_finished: int = MAX_FINISHED) -> dict:
    """A JSON-ready picture of an :class:`~minillm.serving.engine.LLMEngine` now.

    Call it where the engine cannot step meanwhile (the server holds ``AsyncEngine.lock``).
    Keys:

    - ``pool``: ``num_blocks``, ``block_size``, ``num_used_blocks``, ``num_free_blocks``,
      ``num_cached_blocks`` (the allocator's own counts: a cached block may be free or held),
      ``num_cached_free_blocks`` (free blocks still holding a hash: what a new prompt can hit
      without any request holding them),
      ``blocks``: the first ``max_blocks`` blocks in id order, each ``{"state": "free"}``,
      ``{"state": "cached"}`` (free, but still named by a hash: a prefix hit can reuse it) or
      ``{"state": "used", "request_ids": [...], "ref_count": n}`` (n > 1: a shared prefix block).
    - ``step``: the latest step, or None before the first: ``index``, ``duration_ms``,
      ``age_ms`` (since it ended), ``num_prefill_tokens``, ``num_decode_tokens``,
      ``rows``: ``[{"request_id", "prefill_tokens", "decode_tokens"}]`` in batch order,
      ``preempted`` and ``finished`` (request ids).
    - ``queues``: ``waiting`` and ``running`` counts (the scheduler's queues).
    - ``limits``: the scheduler's ``max_num_seqs``, ``max_num_batched_tokens``,
      ``enable_chunked_prefill``.
    - ``running``: per running request ``request_id``, ``num_prompt_tokens``,
      ``num_output_tokens``, ``num_computed_tokens``, ``num_cached_tokens``, ``num_blocks``.
    - ``waiting``: per waiting request, in queue order, ``request_id``, ``num_prompt_tokens``,
      ``num_output_tokens`` and ``num_preemptions`` (> 0: it lost its blocks and waits for a recompute).
    - ``finished``: the ``max_finished`` most recently finished requests, newest first:
      ``request_id``, ``finish_reason``, ``num_prompt_tokens``, ``num_output_tokens``,
      ``num_cached_tokens``, ``ttft_ms``, ``tpot_ms`` (from arrival, as
      :func:`~minillm.serving.run_metrics.request_metrics`; None without the tokens to measure).
    """
    scheduler = engine.scheduler
    return {
        "pool": pool_state(engine.cache.allocator, max_blocks),
        "step": step_state(engine.steps[-1]) if engine.steps else None,
        "queues": {"waiting": len(scheduler.waiting), "running": len(scheduler.running)},
        "limits": {"max_num_seqs": scheduler.max_num_seqs,
                   "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                   "enable_chunked_prefill": scheduler.enable_chunked_prefill},
        "running": [_running_row(r, engine.cache.allocator) for r in scheduler.running],
        "waiting": [{"request_id": r.request_id, "num_prompt_tokens": r.num_prompt_tokens,
                     "num_output_tokens": len(r.output_ids), "num_preemptions": r.num_preemptions}
                    for r in scheduler.waiting],
        "finished": finished_rows(engine.requests, max_finished),
    }


def pool_state(allocator, max_blocks: int = MAX_BLOCKS) -> dict:
    """The pool's counts and its first ``max_blocks`` blocks (see :func:`engine_state`)."""
    holders: dict[int, list[str]] = {}  # block id -> the requests whose tables hold it
    for request_id, table in allocator.block_tables.items():
        for block_id in table:
            holders.setdefault(block_id, []).append(request_id)
    blocks = []
    for block in allocator.blocks[:max_blocks]:
        if block.ref_count:
            blocks.append({"state": USED, "request_ids": holders.get(block.block_id, []),
                           "ref_count": block.ref_count})
        else:
            blocks.append({"state": CACHED if block.block_hash is not None else FREE})
    cached_free = sum(1 for block in allocator.blocks if block.ref_count == 0 and block.block_hash is not None)
    return {"num_blocks": allocator.num_blocks, "block_size": allocator.block_size,
            "num_used_blocks": allocator.num_used_blocks, "num_free_blocks": allocator.num_free_blocks,
            "num_cached_blocks": allocator.num_cached_blocks, "num_cached_free_blocks": cached_free,
            "blocks": blocks}


def step_state(step: StepRecord, now_s: float | None = None) -> dict:
    """One :class:`StepRecord` as JSON; ``age_ms`` from its end to ``now_s`` (default now)."""
    now_s = time.perf_counter() if now_s is None else now_s
    return {"index": step.step, "duration_ms": round(step.time_ms, 3),
            "age_ms": round(max(0.0, now_s - step.end_s) * 1e3, 3),
            "num_prefill_tokens": step.num_prefill_tokens, "num_decode_tokens": step.num_decode_tokens,
            "rows": [{"request_id": rid, "prefill_tokens": p, "decode_tokens": d} for rid, p, d in step.scheduled],
            "preempted": list(step.preempted), "finished": list(step.finished)}


def _running_row(request, allocator) -> dict:
    return {"request_id": request.request_id, "num_prompt_tokens": request.num_prompt_tokens,
            "num_output_tokens": len(request.output_ids), "num_computed_tokens": request.num_computed_tokens,
            "num_cached_tokens": request.num_cached_tokens,
            "num_blocks": len(allocator.block_tables.get(request.request_id, ()))}


def finished_rows(requests: dict, max_finished: int = MAX_FINISHED) -> list[dict]:
    """The newest ``max_finished`` finished requests of ``engine.requests``, newest first."""
    done = heapq.nlargest(max_finished, (r for r in requests.values() if r.finished), key=lambda r: r.finish_s)
    return [_finished_row(r) for r in done]


def _finished_row(request) -> dict:
    ttft_ms = tpot_ms = None
    if request.token_times_s and request.first_scheduled_s is not None:  # an abort may end it before any token
        metrics = request_metrics(request)
        ttft_ms = round(metrics.ttft_ms, 3)
        tpot_ms = None if metrics.tpot_ms is None else round(metrics.tpot_ms, 3)
    return {"request_id": request.request_id, "finish_reason": request.finish_reason,
            "num_prompt_tokens": request.num_prompt_tokens, "num_output_tokens": len(request.output_ids),
            "num_cached_tokens": request.num_cached_tokens, "ttft_ms": ttft_ms, "tpot_ms": tpot_ms}


def page_html() -> str:
    """The web view's page: one self-contained HTML file shipped as package data."""
    return resources.files("minillm.serving.server").joinpath("web", "index.html").read_text(encoding="utf-8")
