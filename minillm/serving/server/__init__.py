"""``minillm serve``: the batching engine behind an OpenAI-compatible HTTP server.

Built on the engine (:mod:`minillm.serving`), which never imports this package:

    async_engine.py  AsyncEngine: the engine in one thread, fed by asyncio clients (adds, aborts, streams)
    protocol.py      OpenAI's request fields (pydantic, strict), its answers and chunks, its error JSON
    app.py           create_app: the FastAPI app (/v1/completions, /v1/chat/completions, ...), run_in_thread
    metrics.py       /metrics: vLLM's Prometheus metrics under minillm:
    web_view.py      engine_state(engine): the pool, the step, the queues as JSON; the live page
                     (web/index.html) at GET /
"""
