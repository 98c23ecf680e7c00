"""What every route shares: the request's catalog, a strict request-model base, and the documented errors."""
from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from ..backends import Catalog

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TEXT_OR_TOKENS = "a string, an array of strings, an array of token ids or an array of token-id arrays"


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


def _token_list(value) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def check_text_or_tokens(value):
    """Accept exactly OpenAI's four input shapes (TEXT_OR_TOKENS); token ids must fit int64 (the service
    judges their range). For PlainValidator: raises ValueError."""
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(x, str) for x in value)):
        return value
    if isinstance(value, list) and (_token_list(value) or all(_token_list(x) for x in value)):
        for ids in value if value and isinstance(value[0], list) else [value]:
            if any(not INT64_MIN <= t <= INT64_MAX for t in ids):
                raise ValueError("token ids must be 64-bit integers")
        return value
    raise ValueError(f"must be {TEXT_OR_TOKENS}")


def as_batch(value) -> list[str | list[int]]:
    """A checked input -> its items: one string or token-id array alone, else the list; `[]` stays empty."""
    if isinstance(value, str) or (value and _token_list(value)):
        return [value]
    return list(value)


TEXT_OR_TOKENS_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "string"}},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
]}
