"""Serving many users: continuous batching over a paged KV cache.

One concept per file, in the order a request meets them:

    request.py          Request: its tokens, num_computed_tokens, its timeline
    block_allocator.py  BlockAllocator: free queue, reference counts, block tables, prefix hits
    paged_cache.py      PagedKVCache: the K/V pool of blocks, sized from a memory budget
    scheduler.py        Scheduler: each step's batch under a token budget; chunked prefill; preemption
    paged_attention.py  PagedBatch: a step's tokens laid flat; attention through block tables
    model_runner.py     a scheduled batch -> one forward pass -> one token per finished row
    engine.py           LLMEngine: add_request / step / generate (vLLM's names)
    step_trace.py       StepRecord: what each step did (the timeline, the Chrome trace)
    kv_tiers/           blocks beyond the pool: host memory, disk (shared, crash-safe), cache points,
                        load or recompute by the cost model (KVOffload, the pool's eviction hook)
    run_metrics.py      TTFT, TPOT, ITL, queueing, percentiles, SLO attainment, goodput of a run

Around the engine, in other packages that import it (the engine imports neither server/ nor bench):

    server/             minillm serve: AsyncEngine (typed commands into the engine thread), the
                        OpenAI-compatible FastAPI app (admission checks, routes/ one module per endpoint
                        group), /metrics, the live web view
    minillm.bench       serving.py, workload.py, http_client.py, metrics_scrape.py: the serving benchmark
    minillm.views       serving_terminal.py, serving_plots.py: the step trace as rich tables and plots
"""

from .block_allocator import BlockAllocator
from .engine import LLMEngine, RequestOutput
from .paged_cache import PagedKVCache
from .request import Request
from .scheduler import ScheduledBatch, Scheduler
from .step_trace import StepRecord

__all__ = ["BlockAllocator", "LLMEngine", "PagedKVCache", "Request", "RequestOutput", "ScheduledBatch", "Scheduler",
           "StepRecord"]
