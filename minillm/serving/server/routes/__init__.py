"""The HTTP endpoints, one module per group, each a FastAPI ``router`` of module-level handlers
(vLLM's entrypoints are laid out the same way); ``create_app`` (app.py) includes them in this order:

    web.py           GET  /, /engine/state                  the live view of the engine (what it draws is
                                                            ../web_view.py's, which needs no FastAPI)
    health.py        GET|HEAD /health, GET /metrics         for load balancers and Prometheus, no API key
    models.py        GET  /v1/models, /v1/models/{id}       the one model served
    completions.py   POST /v1/completions, /v1/chat/completions    generation, whole or streamed
    tokenize.py      POST /tokenize, /detokenize, GET /tokenizer_info   vLLM's tokenizer endpoints

A handler reads what the app shares (the AsyncEngine, the tokenizer, the model's name, the limits)
from ``request.app.state``, set once by ``create_app``; the checks every request passes are in
admission.py, the answer (whole or server-sent events) in responses.py. The generating and tokenizer
routers carry ``Depends(check_api_key)``. FastAPI makes a handler's docstring its operation's
description in /openapi.json, so the handlers keep the docstrings they had and no more (each module's
docstring describes its routes); a handler's name makes its operation id, so the names stay too.
"""
