"""The server's Prometheus metrics: vLLM's names (docs.vllm.ai, "Production Metrics") under ``minillm:``.

    histograms  minillm:time_to_first_token_seconds     arrival at the engine -> first token
                minillm:inter_token_latency_seconds     gap between consecutive tokens of a request
                minillm:e2e_request_latency_seconds     arrival at the engine -> finished
                minillm:request_queue_time_seconds      arrival at the engine -> first scheduled
    gauges      minillm:num_requests_running, minillm:num_requests_waiting
                minillm:kv_cache_usage_perc             used blocks / pool blocks (0..1, as vLLM's)
    counters    minillm:prompt_tokens_total, minillm:generation_tokens_total
                minillm:prefix_cache_queries_total      prompt tokens looked up in the prefix cache
                minillm:prefix_cache_hits_total         of those, tokens found (hit rate = hits / queries)
                minillm:request_success_total{finished_reason="stop"|"length"|"abort"}
                minillm:num_preemptions_total           times a request lost its blocks (recomputed later)

Times are taken inside the engine (``Request.arrival_s``, ``token_times_s``, ``finish_s``), so
they leave out HTTP and tokenisation: a client-side benchmark sees that gap. A request counts
when it finishes; the gauges are read from the engine, under its lock, at each scrape.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..request import Request
from .protocol import finish_reason

# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The metrics of one server, in their own registry (two apps in a process never collide).

    ``observe_finished(request)`` is the :class:`AsyncEngine`'s ``on_finished`` hook;
    ``exposition()`` is the /metrics body (Prometheus text format 0.0.4).
    """

    def __init__(self, async_engine):
        prometheus_client.disable_created_metrics()  # no `_created` twin of each counter (vLLM drops them too)
        self.registry = registry = CollectorRegistry()
        engine = async_engine.engine

        def under_lock(read):
            def value() -> float:
                with async_engine.lock:
                    return read()
            return value

        self.ttft = Histogram("minillm:time_to_first_token_seconds", "Time to first token (s)",
                              buckets=TTFT_BUCKETS_S, registry=registry)
        self.itl = Histogram("minillm:inter_token_latency_seconds", "Time between consecutive output tokens (s)",
                             buckets=ITL_BUCKETS_S, registry=registry)
        self.e2e = Histogram("minillm:e2e_request_latency_seconds", "Arrival to finish of a request (s)",
                             buckets=E2E_BUCKETS_S, registry=registry)
        self.queue_time = Histogram("minillm:request_queue_time_seconds", "Arrival to first scheduled (s)",
                                    buckets=E2E_BUCKETS_S, registry=registry)
        Gauge("minillm:num_requests_running", "Requests in the running batch", registry=registry
              ).set_function(under_lock(lambda: len(engine.scheduler.running)))
        Gauge("minillm:num_requests_waiting", "Requests waiting for a first slot or after preemption",
              registry=registry).set_function(under_lock(lambda: len(engine.scheduler.waiting)))
        pool = engine.cache.allocator
        Gauge("minillm:kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (0..1)", registry=registry
              ).set_function(under_lock(lambda: pool.num_used_blocks / pool.num_blocks))
        self.prompt_tokens = Counter("minillm:prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("minillm:generation_tokens", "Generated tokens of finished requests",
                                         registry=registry)
        self.prefix_queries = Counter("minillm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=registry)
        self.prefix_hits = Counter("minillm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=registry)
        self.success = Counter("minillm:request_success", "Finished requests by finish reason",
                               ["finished_reason"], registry=registry)
        self.preemptions = Counter("minillm:num_preemptions", "Times a request lost its KV blocks to make room",
                                   registry=registry)

    def observe_finished(self, request: Request) -> None:
        """Count a finished request (any reason) and record its latencies.

        A request with n > 1 comes here once per sequence: the sequences 1..n-1 (forked after the
        prompt's prefill) add their generated tokens, token gaps and preemptions; the prompt, the
        prefix cache, TTFT, queue time, e2e and the request's success are counted once, by sequence 0.
        """
        times = request.token_times_s
        for before, after in zip(times, times[1:]):
            self.itl.observe(after - before)
        self.generation_tokens.inc(len(request.output_ids))
        self.preemptions.inc(request.num_preemptions)
        if request.index > 0:
            return
        if times:
            self.ttft.observe(times[0] - request.arrival_s)
        self.e2e.observe(request.finish_s - request.arrival_s)
        if request.first_scheduled_s is not None:  # it reached the prefix cache lookup
            self.queue_time.observe(request.first_scheduled_s - request.arrival_s)
            self.prefix_queries.inc(request.num_prompt_tokens)
            self.prefix_hits.inc(request.num_cached_tokens)
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.success.labels(finished_reason=finish_reason(request.finish_reason)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
