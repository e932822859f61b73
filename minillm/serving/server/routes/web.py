"""The live view of the engine (its state and page are web_view.py's, which needs no FastAPI)::

    GET  /               the page, never cached (a new server may have a new page)
    GET  /engine/state   engine_state(engine) as JSON, read under the engine's lock
"""

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from ..web_view import engine_state, page_html

# (No ``from __future__ import annotations`` here: FastAPI must see the real ``Request`` class.)

router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def index() -> HTMLResponse:
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-store"})


# A plain def, not async: FastAPI runs it in a worker thread, so waiting for the lock while
# a step runs (hundreds of ms on a CPU) does not stall the event loop that streams tokens.
@router.get("/engine/state")
def state(request: Request) -> dict:
    async_engine = request.app.state.async_engine
    with async_engine.lock:
        return engine_state(async_engine.engine)
