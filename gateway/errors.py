"""HTTP glue for the one error table (services/common/errors.py): every failure leaves as an OpenAI error object,
except under Anthropic's routes (ANTHROPIC_PATHS), where it leaves in Anthropic's error shape.

FastAPI's own 422 validation answers become 400s; its 404/405 become the route's
shape too; anything unexpected is a 500 logged with the request id.
"""
from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from services.common.errors import (
    REASON_KEY,
    Internal,
    InvalidArgument,
    TesseraError,
    from_rpc_error,
    http_error,
)

from .backends import OWN_WORDS

log = logging.getLogger("tessera.gateway")


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", "") or "-"


# Anthropic's Messages API (gateway/routes/messages.py): its clients read its own error shape.
ANTHROPIC_PATHS = ("/v1/messages",)
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "api_error"}


def anthropic_error(err: TesseraError, rid: str | None) -> dict:
    """Anthropic's error body for err: {"type": "error", "error": {"type", "message"}, "request_id"}."""
    # Anthropic's shape has no `param`: the message names the field instead.
    message = err.message if not err.param or err.param in err.message else f"{err.param}: {err.message}"
    body = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.row.http, "api_error"), "message": message}}
    if rid:
        body["request_id"] = rid
    return body


def anthropic_route(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def error_response(err: TesseraError, rid: str | None, path: str = "",
                   retry_after: int | None = None) -> JSONResponse:
    """retry_after: the Retry-After seconds when known (an overloaded error otherwise says 1)."""
    status, body, headers = http_error(err, rid)
    if retry_after is not None:
        headers = {**headers, "Retry-After": str(retry_after)}
    if anthropic_route(path):
        body = anthropic_error(err, rid)
    if rid:
        headers = {**headers, "x-request-id": rid}
    return JSONResponse(body, status_code=status, headers=headers)


def _where(loc) -> str:
    """'input[0]' from pydantic's ('body', 'input', 0); union-branch tags are dropped."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "bool", "float", "function-plain", "function-after"):
            continue
        else:
            out += f".{part}" if out else part
    return out


def validation_error(exc: RequestValidationError) -> InvalidArgument:
    """One 400 naming the offending fields, from pydantic's error list."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return InvalidArgument("request body is not valid JSON", param=None)
    parts, first = [], None
    for e in errors:
        where = _where(e.get("loc", ()))
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        text = f"{where}: {msg}" if where else msg
        if text not in parts:
            parts.append(text)
        first = first or where or None
    head = first.split("[")[0].split(".")[0] if first else None
    return InvalidArgument("invalid request: " + "; ".join(parts[:4]), param=head)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every failure into an OpenAI error object."""

    @app.exception_handler(TesseraError)
    async def _typed(request: Request, exc: TesseraError):
        if exc.reason == "INTERNAL":
            log.error("internal error (request_id=%s): %s", request_id(request), exc.message)
        return error_response(exc, request_id(request), request.url.path)

    @app.exception_handler(grpc.aio.AioRpcError)
    async def _rpc(request: Request, exc: grpc.aio.AioRpcError):
        # A call made outside Backend.call: a service's own refusal keeps its message; a transport failure's
        # details name addresses, so they go to the log only (as Backend.public_error does).
        rid = request_id(request)
        err = from_rpc_error(exc)
        if not dict(exc.trailing_metadata() or ()).get(REASON_KEY) and exc.code() not in OWN_WORDS:
            log.warning("backend call failed: %s: %s (request_id=%s)", exc.code().name, exc.details(), rid)
            err.message = f"a backend call failed: {exc.code().name}"
        return error_response(err, rid, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc), request_id(request), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        rid = request_id(request)
        if exc.status_code in (404, 405):
            # Routing failures are not in the error table: no model or argument is at fault.
            what = "no such endpoint" if exc.status_code == 404 else "method not allowed"
            body = {"error": {"message": f"{what}: {request.method} {request.url.path}",
                              "type": "invalid_request_error", "param": None,
                              "code": "not_found" if exc.status_code == 404 else "method_not_allowed",
                              "request_id": rid}}
            if anthropic_route(request.url.path):
                body = {"type": "error", "error": {"type": "not_found_error" if exc.status_code == 404 else
                                                   "invalid_request_error", "message": body["error"]["message"]},
                        "request_id": rid}
            return JSONResponse(body, status_code=exc.status_code, headers={"x-request-id": rid})
        # FastAPI raises a 400 HTTPException when it cannot read the body at all.
        err = InvalidArgument(f"malformed request body: {exc.detail}") if exc.status_code == 400 \
            else Internal(str(exc.detail))
        return error_response(err, rid, request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        rid = request_id(request)
        log.error("unhandled error (request_id=%s)", rid, exc_info=exc)
        return error_response(Internal(f"internal error (request_id={rid})"), rid, request.url.path)
