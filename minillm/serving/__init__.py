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
    workload.py         seeded Poisson arrivals, prompt and output lengths
    run_metrics.py      TTFT, TPOT, ITL, queueing, percentiles, SLO attainment, goodput of a run
    bench.py            one workload through one-at-a-time, static and continuous batching, measured
    render.py, plots.py the step trace as rich tables, timelines, rate sweeps and ITL plots
    async_engine.py     AsyncEngine: the engine in one thread, fed by asyncio clients (adds, aborts, streams)
    openai_protocol.py  OpenAI's request fields (pydantic, strict), its answers and chunks, its error JSON
    api_server.py       create_app: minillm serve's FastAPI app (/v1/completions, /v1/chat/completions, ...)
    server_metrics.py   /metrics: vLLM's Prometheus metrics under minillm:
    http_client_bench.py the same workload sent to a server over HTTP, timed on the client
    metrics_scrape.py   a server's own latencies from two /metrics scrapes (before/after a run)
    web_view.py         engine_state(engine): the pool, the step, the queues as JSON; the live page
                        (web/index.html) at GET / of minillm serve
"""

from .block_allocator import BlockAllocator
from .engine import LLMEngine, RequestOutput
from .paged_cache import PagedKVCache
from .request import Request
from .scheduler import ScheduledBatch, Scheduler
from .step_trace import StepRecord

__all__ = ["BlockAllocator", "LLMEngine", "PagedKVCache", "Request", "RequestOutput", "ScheduledBatch", "Scheduler",
           "StepRecord"]
