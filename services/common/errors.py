"""The one error table: typed errors -> gRPC status + reason -> HTTP status + OpenAI error object.

Services raise the typed errors below; `grpc_errors` turns them into an aborted
call carrying the reason in trailing metadata; the gateway reads it back with
`from_rpc_error` and answers with `http_error`.
"""
from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import grpc

log = logging.getLogger("tessera.errors")

REASON_KEY = "tessera-reason"
PARAM_KEY = "tessera-param"


@dataclass(frozen=True)
class Row:
    code: grpc.StatusCode
    http: int
    openai_type: str


# reason (ErrorReason name without its prefix) -> gRPC code, HTTP status, OpenAI error type
TABLE: dict[str, Row] = {
    "INVALID_ARGUMENT": Row(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    "TOO_LARGE": Row(grpc.StatusCode.INVALID_ARGUMENT, 413, "invalid_request_error"),
    "CONTEXT_LENGTH": Row(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    "UNSUPPORTED": Row(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    "MODEL_NOT_FOUND": Row(grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    "ADAPTER_NOT_FOUND": Row(grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    "ADAPTER_IN_USE": Row(grpc.StatusCode.FAILED_PRECONDITION, 409, "conflict_error"),
    "OVERLOADED": Row(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    "UNAVAILABLE": Row(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    "DEADLINE": Row(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    "INTERNAL": Row(grpc.StatusCode.INTERNAL, 500, "server_error"),
    "UNAUTHENTICATED": Row(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    "PERMISSION_DENIED": Row(grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
}

# A status that arrives without a reason (transport failures, other servers) still maps.
_CODE_TO_REASON = {
    grpc.StatusCode.INVALID_ARGUMENT: "INVALID_ARGUMENT",
    grpc.StatusCode.OUT_OF_RANGE: "INVALID_ARGUMENT",
    grpc.StatusCode.NOT_FOUND: "MODEL_NOT_FOUND",
    grpc.StatusCode.FAILED_PRECONDITION: "ADAPTER_IN_USE",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "OVERLOADED",
    grpc.StatusCode.UNAVAILABLE: "UNAVAILABLE",
    grpc.StatusCode.CANCELLED: "UNAVAILABLE",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DEADLINE",
    grpc.StatusCode.UNAUTHENTICATED: "UNAUTHENTICATED",
    grpc.StatusCode.PERMISSION_DENIED: "PERMISSION_DENIED",
}


class TesseraError(Exception):
    """Base of every error a user can cause or see. `reason` keys TABLE."""

    reason = "INTERNAL"
    # The OpenAI body's `code`; None: the reason's name. A subclass that reuses a row for a different thing
    # (a stored response, not a model, that is not found) names the thing here.
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def row(self) -> Row:
        return TABLE[self.reason]


class InvalidArgument(TesseraError):
    reason = "INVALID_ARGUMENT"


class TooLarge(TesseraError):
    reason = "TOO_LARGE"


class ContextLengthExceeded(TesseraError):
    reason = "CONTEXT_LENGTH"


class Unsupported(TesseraError):
    reason = "UNSUPPORTED"


class ModelNotFound(TesseraError):
    reason = "MODEL_NOT_FOUND"


class AdapterNotFound(TesseraError):
    reason = "ADAPTER_NOT_FOUND"


class AdapterInUse(TesseraError):
    reason = "ADAPTER_IN_USE"


class Overloaded(TesseraError):
    reason = "OVERLOADED"


class Unavailable(TesseraError):
    reason = "UNAVAILABLE"


class DeadlineExceeded(TesseraError):
    reason = "DEADLINE"


class Internal(TesseraError):
    reason = "INTERNAL"


class Unauthenticated(TesseraError):
    reason = "UNAUTHENTICATED"


class PermissionDenied(TesseraError):
    reason = "PERMISSION_DENIED"


_BY_REASON = {cls.reason: cls for cls in TesseraError.__subclasses__()}


def error_for(reason: str, message: str, param: str | None = None) -> TesseraError:
    """The typed error for a reason name; unknown names become Internal."""
    return _BY_REASON.get(reason, Internal)(message, param=param)


async def abort(context: grpc.aio.ServicerContext, err: TesseraError) -> None:
    """End the call with err's status, reason and param in trailing metadata."""
    metadata = [(REASON_KEY, err.reason)]
    if err.param:
        metadata.append((PARAM_KEY, err.param))
    context.set_trailing_metadata(tuple(metadata))
    await context.abort(err.row.code, err.message)


def _request_id(request) -> str:
    return getattr(request, "request_id", "") or "-"


def grpc_errors(method):
    """Decorate an aio servicer method (unary or server-streaming).

    Cancellation (a BaseException) passes through untouched.

    TesseraError -> its status; any other exception is a bug: logged with the
    request id and answered INTERNAL, so the server stays up.
    """
    async def _handle(exc, request, context):
        if isinstance(exc, TesseraError):
            await abort(context, exc)
        rid = _request_id(request)
        log.exception("internal error in %s (request_id=%s)", method.__qualname__, rid)
        await abort(context, Internal(f"internal error (request_id={rid})"))

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure must become a status
                await _handle(exc, request, context)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must become a status
            await _handle(exc, request, context)
    return unary


def from_rpc_error(exc: grpc.aio.AioRpcError | grpc.RpcError) -> TesseraError:
    """The typed error a failed call carried (reason from trailing metadata, else from its code)."""
    code = exc.code()
    meta = dict(exc.trailing_metadata() or ())
    reason = meta.get(REASON_KEY) or _CODE_TO_REASON.get(code, "INTERNAL")
    message = exc.details() or code.name.lower()
    if reason == "UNAVAILABLE" and not meta.get(REASON_KEY):
        message = f"backend unavailable: {message}"
    return error_for(reason, message, meta.get(PARAM_KEY))


def openai_error(err: TesseraError, request_id: str | None = None) -> dict:
    """OpenAI's error object for err."""
    body = {"message": err.message, "type": err.row.openai_type, "param": err.param,
            "code": err.code or err.reason.lower()}
    if request_id:
        body["request_id"] = request_id
    return {"error": body}


def http_error(err: TesseraError, request_id: str | None = None) -> tuple[int, dict, dict]:
    """(HTTP status, OpenAI error body, extra headers) for err."""
    headers = {"Retry-After": "1"} if err.reason == "OVERLOADED" else {}
    return err.row.http, openai_error(err, request_id), headers
