"""The gateway's HTTP edge over a real gRPC server whose servicer fails on demand.

The servicer stands in for the pooling service only to make every error reason
of the table travel the real path: typed error -> grpc_errors -> trailing
metadata -> from_rpc_error -> HTTP status + OpenAI error object. The real
pooling service is exercised in test_e2e.py.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from gateway.config import GatewayConfig
from services.common.errors import TABLE, error_for, grpc_errors
from services.common.pb import common_pb2, pooling_pb2, pooling_pb2_grpc
from services.common.server import Server, ServerConfig
from tests.conftest import free_port
from tests.gateway.fleet import GatewayThread, LoopThread

KEY = "sk-edge-tenant-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_KEY = "sk-edge-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LIMIT = 4096


class FailingPooling(pooling_pb2_grpc.PoolingServiceServicer):
    """Embeds each text as [len(text), 0, 1]; a text 'fail:REASON' raises that reason; 'sleep' outlasts deadlines."""

    def __init__(self):
        self.request_ids = []

    @grpc_errors
    async def Embed(self, request, context):
        self.request_ids.append(request.request_id)
        rows = []
        for item in request.inputs:
            text = item.text
            if text.startswith("fail:"):
                raise error_for(text[5:], f"asked to fail with {text[5:]}", param="inputs[0]")
            if text == "sleep":
                await asyncio.sleep(2)
            if text == "malformed":  # a backend bug: 4 bytes for a [1, 3] float32 tensor
                return pooling_pb2.EmbedResponse(embeddings=common_pb2.Tensor(
                    data=b"\0" * 4, dtype=common_pb2.DTYPE_FLOAT32, shape=[1, 3]))
            rows.append([float(len(text)), 0.0, 1.0])
        data = np.asarray(rows, dtype="<f4")
        return pooling_pb2.EmbedResponse(
            model=request.model,
            embeddings=common_pb2.Tensor(data=data.tobytes(), dtype=common_pb2.DTYPE_FLOAT32, shape=data.shape),
            usage=common_pb2.Usage(prompt_tokens=len(rows), total_tokens=len(rows)))

    @grpc_errors
    async def GetModelInfo(self, request, context):
        return pooling_pb2.GetModelInfoResponse(models=[pooling_pb2.ModelInfo(
            name="fake-embedder", kind=pooling_pb2.MODEL_KIND_EMBEDDING, max_model_len=16, dimensions=3)])


@pytest.fixture(scope="module")
def backend():
    loop = LoopThread()
    servicer = FailingPooling()
    name = pooling_pb2.DESCRIPTOR.services_by_name["PoolingService"].full_name

    async def start():  # an aio server belongs to the loop it is created in
        server = Server(ServerConfig(host="127.0.0.1", port=free_port(), drain_seconds=0),
                        lambda s: pooling_pb2_grpc.add_PoolingServiceServicer_to_server(servicer, s), [name])
        await server.start()
        await server.set_serving(True)
        return server
    server = loop.run(start())
    yield loop, server, servicer
    loop.run(server.stop(0))
    loop.close()


@pytest.fixture(scope="module")
def gateway(backend):
    _, server, _ = backend
    cfg = GatewayConfig(port=free_port(), pooling=f"127.0.0.1:{server.port}", api_key=KEY, admin_key=ADMIN_KEY,
                        max_body_bytes=LIMIT, grpc_timeout_s=0.5, health_timeout_s=0.5, model_refresh_s=0)
    with GatewayThread(cfg) as gw:
        with httpx.Client(base_url=gw.url, headers=AUTH, timeout=10) as client:
            yield client


def assert_openai_error(reply: httpx.Response, status: int, code: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    err = reply.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert {"type", "param", "code"} <= set(err)
    if code:
        assert err["code"] == code
    assert reply.headers["x-request-id"] == err["request_id"]
    return err


@pytest.mark.parametrize("reason", sorted(TABLE))
def test_each_reason_maps_to_its_http_status(gateway, reason):
    reply = gateway.post("/v1/embeddings", json={"input": f"fail:{reason}", "model": "fake-embedder"})
    err = assert_openai_error(reply, TABLE[reason].http, reason.lower())
    assert err["type"] == TABLE[reason].openai_type
    assert err["param"] == "input"  # the proto's "inputs[0]" named as the HTTP field
    assert ("retry-after" in reply.headers) == (reason == "OVERLOADED")
    # The service stays up: the next request is answered.
    assert gateway.post("/v1/embeddings", json={"input": "ok"}).status_code == 200


def test_embeddings_roundtrip_and_request_id(gateway, backend):
    reply = gateway.post("/v1/embeddings", json={"input": ["a", "abc"], "encoding_format": "float"},
                         headers={"x-request-id": "my-id-1"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-request-id"] == "my-id-1"
    assert backend[2].request_ids[-1] == "my-id-1"
    body = reply.json()
    assert [d["embedding"] for d in body["data"]] == [[1.0, 0.0, 1.0], [3.0, 0.0, 1.0]]
    assert body["model"] == "fake-embedder" and body["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    # A request id that is not plain text is replaced, never echoed.
    reply = gateway.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "bad id;drop"})
    assert reply.headers["x-request-id"] != "bad id;drop" and len(reply.headers["x-request-id"]) == 32


def test_malformed_backend_answer_is_500_with_request_id(gateway, caplog):
    reply = gateway.post("/v1/embeddings", json={"input": "malformed"}, headers={"x-request-id": "bug-1"})
    err = assert_openai_error(reply, 500, "internal")
    assert "malformed embedding tensor" in err["message"] and err["request_id"] == "bug-1"
    assert any("bug-1" in r.getMessage() for r in caplog.records)


def test_deadline_is_504(gateway):
    assert_openai_error(gateway.post("/v1/embeddings", json={"input": "sleep"}), 504, "deadline")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(gateway, headers):
    with httpx.Client(base_url=str(gateway.base_url), timeout=10) as anon:
        assert_openai_error(anon.post("/v1/embeddings", json={"input": "x"}, headers=headers), 401,
                            "unauthenticated")
        assert_openai_error(anon.get("/v1/models", headers=headers), 401)
        # Probes and the API description need no key.
        for path in ("/health", "/ready", "/metrics", "/openapi.json"):
            assert anon.get(path).status_code == 200, path


def test_body_over_limit_is_413(gateway):
    big = {"input": "x" * (LIMIT + 10)}
    assert_openai_error(gateway.post("/v1/embeddings", json=big), 413, "too_large")

    def chunks():  # no Content-Length: the limit must hold while streaming too
        for _ in range(10):
            yield b" " * 1000
    reply = gateway.post("/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(reply, 413, "too_large")
    assert gateway.post("/v1/embeddings", json={"input": "x"}).status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/v1/embeddings", b"{not json"),
    ("/v1/embeddings", b""),
    ("/v1/embeddings", b"[1, 2]"),
    ("/v1/rerank", b"{\"query\": "),
])
def test_malformed_json_is_400(gateway, path, body):
    reply = gateway.post(path, content=body, headers={"content-type": "application/json"})
    assert_openai_error(reply, 400, "invalid_argument")


@pytest.mark.parametrize("body,param", [
    ({"input": 5}, "input"),
    ({"input": [1.5, 2]}, "input"),
    ({"input": [True]}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": [[1], "a"]}, "input"),
    ({"input": [2**64]}, "input"),
    ({"input": "x", "model": 3}, "model"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "surprise": 1}, "surprise"),
    ({}, "input"),
])
def test_wrong_types_are_400_naming_the_field(gateway, body, param):
    err = assert_openai_error(gateway.post("/v1/embeddings", json=body), 400, "invalid_argument")
    assert err["param"] == param, err
    assert param in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"query": "q", "documents": [1]}, "documents"),
    ({"query": "q", "documents": [{"text": 1}]}, "documents"),
    ({"query": "q", "documents": [{"txt": "a"}]}, "documents"),
    ({"query": "q", "documents": "a"}, "documents"),
    ({"query": 1, "documents": ["a"]}, "query"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
])
def test_rerank_wrong_types_are_400(gateway, body, param):
    err = assert_openai_error(gateway.post("/v1/rerank", json=body), 400, "invalid_argument")
    assert err["param"] == param, err


def test_unknown_model_and_wrong_endpoint(gateway):
    err = assert_openai_error(gateway.post("/v1/embeddings", json={"input": "x", "model": "nope"}), 404,
                              "model_not_found")
    assert "fake-embedder" in err["message"]
    # This fleet serves no reranker: the 404 says so on every alias.
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        err = assert_openai_error(gateway.post(path, json={"query": "q", "documents": ["a"]}), 404,
                                  "model_not_found")
        assert "no reranker is configured" in err["message"]
    err = assert_openai_error(gateway.post("/v1/rerank", json={"query": "q", "documents": ["a"],
                                                               "model": "fake-embedder"}), 400)
    assert "/v1/embeddings" in err["message"]


def test_unknown_route_and_method(gateway):
    assert_openai_error(gateway.get("/v1/nothing"), 404, "not_found")
    assert_openai_error(gateway.get("/v1/embeddings"), 405, "method_not_allowed")


def test_models_metrics_openapi(gateway):
    models = gateway.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["kind"], m["dimensions"]) for m in models["data"]] == \
        [("fake-embedder", "model", "embedding", 3)]
    assert gateway.get("/v1/models/fake-embedder").json()["id"] == "fake-embedder"
    assert_openai_error(gateway.get("/v1/models/nope"), 404)
    metrics = gateway.get("/metrics").text
    assert 'tessera_gateway_requests_total{route="/v1/embeddings",status="200"}' in metrics
    spec = gateway.get("/openapi.json").json()
    assert {"/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/models", "/health", "/ready",
            "/metrics"} <= set(spec["paths"])
    schema = spec["components"]["schemas"]["EmbeddingRequest"]["properties"]["input"]
    assert len(schema["anyOf"]) == 4
    # Validation failures are documented as the 400s they are, never FastAPI's 422.
    responses = spec["paths"]["/v1/embeddings"]["post"]["responses"]
    assert "422" not in responses and responses["400"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/ErrorBody"}


def test_ready_follows_backend_health(gateway, backend):
    """Last in this module: it takes the backend down. Only the admin key sees the backends' addresses and
    states; anyone else, an API key included, learns ready or not."""
    loop, server, _ = backend
    address = f"127.0.0.1:{server.port}"
    assert gateway.get("/ready", headers=ADMIN).json()["backends"] == {f"pooling@{address}": "SERVING"}
    assert gateway.get("/ready").json() == {"status": "ready"}
    loop.run(server.set_serving(False))
    reply = gateway.get("/ready", headers=ADMIN)
    assert reply.status_code == 503
    assert "NOT_SERVING" in reply.json()["error"]["message"]
    loop.run(server.set_serving(True))
    assert gateway.get("/ready").status_code == 200
    loop.run(server.stop(0))
    reply = gateway.get("/ready", headers=ADMIN)
    assert reply.status_code == 503 and "UNREACHABLE" in json.dumps(reply.json()["backends"])
    for headers in ({}, {"Authorization": "Bearer wrong"}, AUTH):
        reply = httpx.get(str(gateway.base_url.join("/ready")), headers=headers, timeout=10)
        assert reply.status_code == 503 and reply.json()["status"] == "not_ready", reply.text
        assert "backends" not in reply.json() and "127.0.0.1" not in reply.text and "pooling" not in reply.text
    assert gateway.get("/health").status_code == 200
    for req in ({"input": "x"}, {"input": "x", "model": "fake-embedder"}):
        err = assert_openai_error(gateway.post("/v1/embeddings", json=req), 503, "unavailable")
        # Which service, never where it is nor gRPC's own words about the connection.
        assert "pooling" in err["message"] and address not in err["message"] and "127.0.0.1" not in err["message"]
        assert "ipv4" not in err["message"] and "connect" not in err["message"].lower(), err
    err = assert_openai_error(gateway.get("/v1/models"), 503, "unavailable")
    assert "127.0.0.1" not in err["message"] and "@" not in err["message"], err


def test_ready_covers_decoder_and_vision_backends():
    """--decoder and --vision backends count for /ready by their own health names."""
    from services.common.pb import decoder_pb2

    loop = LoopThread()
    name = decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"].full_name

    async def start():
        server = Server(ServerConfig(host="127.0.0.1", port=free_port(), drain_seconds=0), lambda s: None, [name])
        await server.start()
        await server.set_serving(True)
        return server
    server = loop.run(start())
    dead = free_port()
    try:
        cfg = GatewayConfig(port=free_port(), decoder=(f"127.0.0.1:{server.port}",), vision=f"127.0.0.1:{dead}",
                            health_timeout_s=0.5, admin_key=ADMIN_KEY)
        with GatewayThread(cfg) as gw:
            reply = httpx.get(gw.url + "/ready", headers=ADMIN, timeout=10)
            assert reply.status_code == 503
            backends = reply.json()["backends"]
            assert backends[f"decoder@127.0.0.1:{server.port}"] == "SERVING"
            assert backends[f"vision@127.0.0.1:{dead}"].startswith("UNREACHABLE")
            assert f"vision@127.0.0.1:{dead}" in reply.json()["error"]["message"]
    finally:
        loop.run(server.stop(0))
        loop.close()


@pytest.mark.parametrize("kwargs,message", [
    ({}, "at least one backend"),
    ({"pooling": "nohost"}, "HOST:PORT"),
    ({"pooling": "h:0"}, "HOST:PORT"),
    ({"pooling": "h:1", "api_key": ""}, "api_key"),
    ({"pooling": "h:1", "grpc_timeout_s": 0}, "grpc_timeout_s"),
])
def test_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**kwargs)


def test_flags_override_env_override_defaults():
    from gateway.config import ENV_PREFIX
    from services.common.config import load

    env = {"TESSERA_GATEWAY_POOLING": "a:1", "TESSERA_GATEWAY_DECODER": "d:1,d:2", "TESSERA_GATEWAY_API_KEY": KEY,
           "TESSERA_GATEWAY_PORT": "9000"}
    (cfg,) = load((GatewayConfig,), ["--pooling", "b:2"], prog="gw", description="", env_prefix=ENV_PREFIX,
                  environ=env)
    assert (cfg.pooling, cfg.decoder, cfg.api_key, cfg.port, cfg.max_body_bytes) == \
        ("b:2", ("d:1", "d:2"), KEY, 9000, 16 * 1024 * 1024)
    with pytest.raises(SystemExit):
        load((GatewayConfig,), ["--pooling", "nope"], prog="gw", description="", env_prefix=ENV_PREFIX,
             environ={})
