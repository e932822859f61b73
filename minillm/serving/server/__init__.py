"""``minillm serve``: the batching engine behind an OpenAI-compatible HTTP server.

Built on the engine (:mod:`minillm.serving`), which never imports this package:

    async_engine.py  AsyncEngine: the engine in one thread, fed by asyncio clients through typed
                     commands (AddRequest, AbortRequest, LoseEngine); streams each request's outputs
    protocol.py      OpenAI's request fields (pydantic, strict), its answers and chunks, its error JSON
    admission.py     what a request must pass before the engine sees it (API key, body, model, prompt
                     fits the context, sampling knobs, grammar): each refusal an APIError, OpenAI's JSON
    responses.py     the engine's outputs as the HTTP answer: whole, or server-sent events
    routes/          the endpoints, one module per group, module-level handlers on APIRouters:
                     completions.py (/v1/completions, /v1/chat/completions), models.py (/v1/models),
                     tokenize.py (/tokenize, /detokenize, /tokenizer_info), health.py (/health, /metrics)
    app.py           create_app: the shared state (app.state), the routers, the error handlers;
                     serve and run_in_thread, with a graceful shutdown
    metrics.py       /metrics: vLLM's Prometheus metrics under minillm:
    web_view.py      engine_state(engine): the pool, the step, the queues as JSON; the page (served by routes/web.py)
                     (web/index.html) at GET /
"""
