"""What every route shares: the request's catalog, a strict request-model base, and the documented errors."""
from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from ..backends import Catalog

INT32_MAX = 2**31 - 1


class StrictBody(BaseModel):
    """A JSON body with exact types (no "5" -> 5, no 1.0 -> 1, no true -> 1) and no unknown fields,
    so nothing a caller sends is silently coerced or dropped."""

    model_config = ConfigDict(strict=True, extra="forbid")


def catalog(request: Request) -> Catalog:
    return request.app.state.catalog


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str
    request_id: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error object; every non-2xx answer of the gateway has this shape."""

    error: ErrorObject


_ERROR_STATUSES = {
    400: "invalid request (malformed JSON, wrong types, unknown fields, bad input)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body over the size limit",
    429: "a backend is overloaded; retry after Retry-After seconds",
    503: "a backend is unavailable",
    504: "a backend call passed its deadline",
}
# For the OpenAPI description of the model-serving routes.
ERROR_RESPONSES = {status: {"model": ErrorBody, "description": why} for status, why in _ERROR_STATUSES.items()}
