"""The one error table: every reason maps to a gRPC status and an HTTP status, and survives the wire."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common import errors
from services.common.errors import (
    TABLE,
    InvalidArgument,
    Overloaded,
    TesseraError,
    error_for,
    from_rpc_error,
    grpc_errors,
    http_error,
)
from services.common.pb import common_pb2

EXPECTED = {
    "INVALID_ARGUMENT": ("INVALID_ARGUMENT", 400), "TOO_LARGE": ("INVALID_ARGUMENT", 413),
    "CONTEXT_LENGTH": ("INVALID_ARGUMENT", 400), "UNSUPPORTED": ("INVALID_ARGUMENT", 400),
    "MODEL_NOT_FOUND": ("NOT_FOUND", 404), "ADAPTER_NOT_FOUND": ("NOT_FOUND", 404),
    "ADAPTER_IN_USE": ("FAILED_PRECONDITION", 409), "OVERLOADED": ("RESOURCE_EXHAUSTED", 429),
    "UNAVAILABLE": ("UNAVAILABLE", 503), "DEADLINE": ("DEADLINE_EXCEEDED", 504), "INTERNAL": ("INTERNAL", 500),
    "UNAUTHENTICATED": ("UNAUTHENTICATED", 401), "PERMISSION_DENIED": ("PERMISSION_DENIED", 403),
}


def test_table_matches_design_and_proto():
    assert {r: (row.code.name, row.http) for r, row in TABLE.items()} == EXPECTED
    proto_reasons = {n.removeprefix("ERROR_REASON_") for n in common_pb2.ErrorReason.keys()} - {"UNSPECIFIED"}
    assert proto_reasons == set(TABLE)
    # One typed error per reason, and error_for finds it.
    for reason in TABLE:
        err = error_for(reason, "m", "p")
        assert err.reason == reason and type(err) is not TesseraError and err.param == "p"
    assert type(error_for("NO_SUCH_REASON", "m")) is errors.Internal


def test_http_error_is_openai_shaped_with_retry_after_on_overload():
    status, body, headers = http_error(InvalidArgument("bad n", param="n"), "req-1")
    assert status == 400 and headers == {}
    assert body == {"error": {"message": "bad n", "type": "invalid_request_error", "param": "n",
                              "code": "invalid_argument", "request_id": "req-1"}}
    status, body, headers = http_error(Overloaded("busy"))
    assert status == 429 and headers["Retry-After"] and body["error"]["type"] == "rate_limit_error"


class _Servicer:
    @grpc_errors
    async def Unary(self, request, context):
        raise request

    @grpc_errors
    async def Stream(self, request, context):
        yield b"first"
        raise request


def _serve_and_call(exc: Exception, streaming: bool):
    """A real aio server whose handler raises exc; returns the client's RpcError."""
    servicer = _Servicer()

    async def unary(request, context):
        return await servicer.Unary(exc, context)

    async def stream(request, context):
        async for item in servicer.Stream(exc, context):
            yield item

    async def run():
        handler = grpc.method_handlers_generic_handler("t.S", {
            "U": grpc.unary_unary_rpc_method_handler(unary, request_deserializer=bytes,
                                                     response_serializer=bytes),
            "S": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=bytes,
                                                      response_serializer=bytes),
        })
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                if streaming:
                    call = ch.unary_stream("/t.S/S", request_serializer=bytes, response_deserializer=bytes)(b"")
                    got = [m async for m in call]
                    raise AssertionError(f"no error, got {got}")
                await ch.unary_unary("/t.S/U", request_serializer=bytes, response_deserializer=bytes)(b"")
        except grpc.aio.AioRpcError as err:
            return err
        finally:
            await server.stop(0)
    return asyncio.run(run())


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("reason", sorted(TABLE))
def test_typed_errors_cross_grpc_with_reason_and_param(reason, streaming):
    err = _serve_and_call(error_for(reason, f"{reason} happened", "field"), streaming)
    assert err.code() == TABLE[reason].code
    back = from_rpc_error(err)
    assert (back.reason, back.message, back.param) == (reason, f"{reason} happened", "field")


@pytest.mark.parametrize("streaming", [False, True])
def test_a_bug_becomes_internal_without_leaking_details(streaming):
    err = _serve_and_call(KeyError("secret internals"), streaming)
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in err.details() and from_rpc_error(err).reason == "INTERNAL"


def test_status_without_reason_still_maps():
    class Bare(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "connection refused"

        def trailing_metadata(self):
            return ()
    err = from_rpc_error(Bare())
    assert err.reason == "UNAVAILABLE" and "connection refused" in err.message
