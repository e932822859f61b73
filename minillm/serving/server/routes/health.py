"""What operators poll, open without an API key::

    GET  /health    200 {"status": "ok"} while the engine thread is alive and can step (HEAD: no body);
                    503 while its last step failed with a failure no request owned, or once it stopped
                    or lost a tensor-parallel rank
    GET  /metrics   Prometheus text: vLLM's metric names under ``minillm:`` (metrics.py)
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..admission import APIError

router = APIRouter()


@router.head("/health", operation_id="health_head")  # one route per method: one OpenAPI operation id each
@router.get("/health", operation_id="health")
async def health(request: Request):
    async_engine = request.app.state.async_engine
    if async_engine.lost is not None:  # a tensor-parallel rank died: every step would fail
        raise APIError(503, f"the engine cannot run: {async_engine.lost}; restart the server", code="engine_dead")
    if not async_engine.is_alive():
        raise APIError(503, "the engine thread has stopped; restart the server")
    if async_engine.step_failure is not None:  # no request owned it; the next step that runs clears it
        raise APIError(503, f"the engine's last step failed ({async_engine.step_failure}); the requests in it "
                            "were ended, new ones are taken")
    return Response(status_code=200) if request.method == "HEAD" else {"status": "ok"}


@router.get("/metrics")
async def prometheus_metrics(request: Request):  # app.state.metrics in Prometheus' text format
    body = await asyncio.to_thread(request.app.state.metrics.exposition)  # the gauges wait for the engine's lock
    return Response(body, media_type=CONTENT_TYPE_LATEST)
