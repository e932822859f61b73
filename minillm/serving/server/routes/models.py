"""The one model served, as OpenAI's model objects::

    GET  /v1/models         {"object": "list", "data": [the model]}
    GET  /v1/models/{id}    the model; 404 model_not_found for another id (ids may hold "/")

The model object carries vLLM's ``max_model_len``: the longest request (prompt and output) this
server takes (``app.max_model_len``).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ..admission import check_api_key, check_model

router = APIRouter(dependencies=[Depends(check_api_key)])


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [model_card(request.app.state)]}


@router.get("/v1/models/{model_id:path}")
async def model_by_id(model_id: str, request: Request):
    check_model(model_id, request.app.state.model_name)
    return model_card(request.app.state)


def model_card(state) -> dict:
    """OpenAI's model object for the app's ``state`` (its model_name, created_s, max_model_len)."""
    return {"id": state.model_name, "object": "model", "created": state.created_s, "owned_by": "minillm",
            "max_model_len": state.max_model_len}
