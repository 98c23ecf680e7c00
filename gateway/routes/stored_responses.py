"""Stored responses: what POST /v1/responses asks of the store (gateway/response_store.py), and GET, DELETE and
POST .../cancel on /v1/responses/{id}. Every lookup is by the caller's tenant (gateway/tenants.py), so another
tenant's id is a 404 exactly like an id that never existed."""
from __future__ import annotations

from fastapi import APIRouter, Request

from services.common.errors import InvalidArgument, ModelNotFound

from ..response_store import ResponseStore, tenant
from .common import ERROR_RESPONSES

router = APIRouter()


class NotFound(ModelNotFound):
    """A stored response that is not there for this key: the 404 row, its own code."""

    code = "response_not_found"


NO_STORE = "this gateway keeps no responses (it runs without --response-store)"


def caller(request: Request) -> str:
    """The tenant of the key the request came with (the edge has checked it already)."""
    key_index = getattr(request.state, "key_index", None)
    if key_index is not None:
        return request.app.state.tenants.id_of(key_index)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = token.strip() if scheme.lower() == "bearer" and token.strip() else request.headers.get("x-api-key")
    return tenant(key)


def _store(request: Request) -> ResponseStore | None:
    return request.app.state.response_store


async def store_for(request: Request, store: bool | None) -> ResponseStore | None:
    """The store to keep this response in, or None. store omitted: true when a store is configured (OpenAI's
    default), false otherwise; store true without one is a 400, and a store that does not answer is a 503
    before any generation is spent."""
    configured = _store(request)
    if store and configured is None:
        raise InvalidArgument(f"store: true is not supported: {NO_STORE}; send false or omit it", param="store")
    if configured is None or store is False:
        return None
    await configured.ping()
    return configured


async def earlier_items(request: Request, previous_response_id: str | None) -> list[dict]:
    """The stored conversation a continuation starts with (none without previous_response_id)."""
    if previous_response_id is None:
        return []
    configured = _store(request)
    if configured is None:
        raise InvalidArgument(f"previous_response_id is not supported: {NO_STORE}; send the earlier items in input",
                              param="previous_response_id")
    record = await configured.get(caller(request), previous_response_id)
    if record is None:
        raise NotFound(f"no stored response {previous_response_id!r} (expired, deleted, stored with"
                       f" store: false, or another tenant's)", param="previous_response_id")
    return record["items"]


async def keep(request: Request, store: ResponseStore, answer: dict, items: list[dict]) -> None:
    await store.put(caller(request), answer["id"], {"response": answer, "items": items})


async def _record(request: Request, response_id: str) -> dict:
    configured = _store(request)
    if configured is None:
        raise NotFound(f"no stored response {response_id!r}: {NO_STORE}", param="response_id")
    record = await configured.get(caller(request), response_id)
    if record is None:
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return record


@router.get("/v1/responses/{response_id}", tags=["generation"], responses=ERROR_RESPONSES)
async def get_response(response_id: str, request: Request) -> dict:
    """A stored response, as it was answered."""
    return (await _record(request, response_id))["response"]


@router.delete("/v1/responses/{response_id}", tags=["generation"], responses=ERROR_RESPONSES)
async def delete_response(response_id: str, request: Request) -> dict:
    """Remove a stored response (a continuation of it is then a 404)."""
    configured = _store(request)
    if configured is None or not await configured.delete(caller(request), response_id):
        raise NotFound(f"no stored response {response_id!r}", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel", tags=["generation"], responses=ERROR_RESPONSES)
async def cancel_response(response_id: str, request: Request) -> dict:
    """Cancel a background run. This gateway runs none (`background: true` is refused), so a stored response is
    a 400, as OpenAI answers for a response that was not created in the background; an unknown id is a 404."""
    await _record(request, response_id)
    raise InvalidArgument(f"response {response_id!r} was not created with background: true, so it cannot be "
                          f"cancelled (this gateway runs no background responses)", param="response_id")
