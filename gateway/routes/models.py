"""GET /v1/models and /v1/models/{id} in OpenAI's list shape, from the backends' GetModelInfo."""
from __future__ import annotations

from fastapi import APIRouter, Request

from services.common.errors import ModelNotFound

from ..backends import Model
from .common import ERROR_RESPONSES, catalog

router = APIRouter()


def model_card(model: Model, created: int, notes: dict[str, str] | None = None) -> dict:
    """OpenAI's model object plus what a caller needs to use it (kind, context length, ...) and the operator's
    --model-note for it, if any (e.g. that its weights are random)."""
    note = (notes or {}).get(model.name)
    # vLLM's fields: an adapter's parent is its base model; root is the model that holds the weights it runs on.
    return {"id": model.name, "object": "model", "created": created, "owned_by": "tessera",
            "root": model.parent or model.name, "parent": model.parent,
            "kind": model.kind, **model.extra, **({"note": note} if note else {})}


@router.get("/v1/models", tags=["models"], responses=ERROR_RESPONSES)
async def list_models(request: Request) -> dict:
    created, notes = request.app.state.started, request.app.state.config.notes
    return {"object": "list", "data": [model_card(m, created, notes) for m in await catalog(request).models()]}


@router.get("/v1/models/{model_id:path}", tags=["models"], responses=ERROR_RESPONSES)
async def get_model(model_id: str, request: Request) -> dict:
    for m in await catalog(request).models():
        if m.name == model_id:
            return model_card(m, request.app.state.started, request.app.state.config.notes)
    raise ModelNotFound(f"model {model_id!r} does not exist", param="model")
