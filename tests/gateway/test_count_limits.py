"""Count limits before validation (gateway/counts.py): too many content parts, tools, logit_bias entries,
embedding inputs or rerank documents are refused with the field named, by the backends' published numbers
(a fake decoder and pooling service publish small ones), in well under a second even for 100,000s of
items, and the gateway keeps answering; counts within the limits pass to the backends."""
from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

from gateway.config import GatewayConfig
from services.common.errors import grpc_errors
from services.common.pb import common_pb2, decoder_pb2, decoder_pb2_grpc, pooling_pb2, pooling_pb2_grpc
from services.common.server import Server, ServerConfig
from tests.conftest import free_port
from tests.gateway.fleet import GatewayThread, LoopThread

LIMITS = decoder_pb2.RequestLimits(max_images=1, max_image_bytes=1000, max_n=2, max_logprobs=2, max_model_len=64,
                                   max_stop_strings=4, max_stop_string_chars=16, max_tools=4, max_logit_bias=8)
MAX_INPUTS = 4


class FakeDecoder(decoder_pb2_grpc.DecoderServiceServicer):
    """Publishes LIMITS; answers every Generate with "ok"."""

    @grpc_errors
    async def GetModelInfo(self, request, context):
        return decoder_pb2.GetModelInfoResponse(name="fake-chat", max_model_len=64, vocab_size=100,
                                                has_chat_template=True, limits=LIMITS)

    @grpc_errors
    async def ListAdapters(self, request, context):
        return decoder_pb2.ListAdaptersResponse()

    @grpc_errors
    async def Generate(self, request, context):
        yield decoder_pb2.GenerateResponse(index=0, text="ok", token_ids=[1],
                                           finish_reason=decoder_pb2.FINISH_REASON_STOP)
        yield decoder_pb2.GenerateResponse(usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1,
                                                                  total_tokens=2))


class FakePooling(pooling_pb2_grpc.PoolingServiceServicer):
    """An embedder and a reranker, each taking MAX_INPUTS items per request."""

    @grpc_errors
    async def GetModelInfo(self, request, context):
        return pooling_pb2.GetModelInfoResponse(models=[
            pooling_pb2.ModelInfo(name="fake-embed", kind=pooling_pb2.MODEL_KIND_EMBEDDING, max_model_len=16,
                                  dimensions=2, max_batch_size=MAX_INPUTS),
            pooling_pb2.ModelInfo(name="fake-rerank", kind=pooling_pb2.MODEL_KIND_RERANK, max_model_len=16,
                                  max_batch_size=MAX_INPUTS)])

    @grpc_errors
    async def Embed(self, request, context):
        data = np.ones((len(request.inputs), 2), dtype="<f4")
        return pooling_pb2.EmbedResponse(model="fake-embed", embeddings=common_pb2.Tensor(
            data=data.tobytes(), dtype=common_pb2.DTYPE_FLOAT32, shape=data.shape))

    @grpc_errors
    async def Rerank(self, request, context):
        return pooling_pb2.RerankResponse(model="fake-rerank", results=[
            pooling_pb2.RerankResult(index=i, relevance_score=0.5) for i in range(len(request.documents))])


@pytest.fixture(scope="module")
def http():
    loop = LoopThread()

    async def start(add, servicer, service: str):
        server = Server(ServerConfig(host="127.0.0.1", port=free_port(), drain_seconds=0),
                        lambda s: add(servicer, s), [service])
        await server.start()
        await server.set_serving(True)
        return server
    decoder = loop.run(start(decoder_pb2_grpc.add_DecoderServiceServicer_to_server, FakeDecoder(),
                             decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"].full_name))
    pooling = loop.run(start(pooling_pb2_grpc.add_PoolingServiceServicer_to_server, FakePooling(),
                             pooling_pb2.DESCRIPTOR.services_by_name["PoolingService"].full_name))
    cfg = GatewayConfig(port=free_port(), decoder=(f"127.0.0.1:{decoder.port}",),
                        pooling=f"127.0.0.1:{pooling.port}", max_content_parts=16)
    try:
        with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as client:
            assert client.get("/v1/models").status_code == 200      # the catalog knows the limits
            yield client
    finally:
        loop.run(decoder.stop(0))
        loop.run(pooling.stop(0))
        loop.close()


def refused(http: httpx.Client, path: str, body: dict, status: int, param: str) -> tuple[str, float]:
    data = json.dumps(body).encode()
    started = time.perf_counter()
    reply = http.post(path, content=data, headers={"content-type": "application/json"})
    took = time.perf_counter() - started
    assert reply.status_code == status, reply.text[:500]
    error = reply.json()["error"]
    assert error.get("param", param) == param, error     # Anthropic's shape has no param: its message names it
    assert http.post("/v1/embeddings", json={"input": "still up"}).status_code == 200
    return error["message"], took


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}


def test_tools_past_the_decoders_limit_are_refused_before_their_schemas_are_checked(http):
    assert http.post("/v1/chat/completions", json=chat(tools=[tool(i) for i in range(4)],
                                                       tool_choice="none")).status_code == 200
    message, _ = refused(http, "/v1/chat/completions", chat(tools=[tool(i) for i in range(5)]), 413, "tools")
    assert "5 tools in one request; at most 4" in message
    # Each of these would fail its schema check; the count comes first, at once.
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
    message, took = refused(http, "/v1/chat/completions", chat(tools=[bad] * 100_000), 413, "tools")
    assert "100000 tools" in message and took < 1.0, took
    responses = {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}] * 5}
    refused(http, "/v1/responses", responses, 413, "tools")
    anthropic = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                 "tools": [{"name": "f", "input_schema": {"type": "object"}}] * 5}
    message, _ = refused(http, "/v1/messages", anthropic, 413, "tools")
    assert "at most 4" in message


def test_logit_bias_past_the_decoders_limit_is_refused_at_once(http):
    assert http.post("/v1/chat/completions", json=chat(logit_bias={str(i): 1 for i in range(8)})).status_code == 200
    message, _ = refused(http, "/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(9)}},
                         413, "logit_bias")
    assert "logit_bias has 9 entries; at most 8" in message
    message, took = refused(http, "/v1/chat/completions", chat(logit_bias={str(i): 1 for i in range(300_000)}),
                            413, "logit_bias")
    assert took < 1.0, took


def test_content_parts_past_the_limit_are_refused(http):
    parts = [{"type": "text", "text": "w"}]
    ok = {"messages": [{"role": "user", "content": parts * 16}]}
    assert http.post("/v1/chat/completions", json=ok).status_code == 200
    message, took = refused(http, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"},
                                          {"role": "user", "content": parts * 400_000}]}, 413, "messages")
    assert "messages[1].content has 400000 parts, over the limit of 16 (max_content_parts)" in message
    assert took < 1.5, took
    responses = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "w"}] * 17}]}
    refused(http, "/v1/responses", responses, 413, "input")


def test_embedding_inputs_and_rerank_documents_past_the_pooling_limit_are_refused(http):
    assert http.post("/v1/embeddings", json={"input": ["w"] * 4}).status_code == 200
    assert http.post("/v1/embeddings", json={"input": list(range(100))}).status_code == 200   # one input of ids
    message, took = refused(http, "/v1/embeddings", {"input": ["w"] * 400_000}, 400, "input")
    assert "input has 400000 items, over the limit of 4" in message and took < 1.0, took
    assert http.post("/v1/rerank", json={"query": "q", "documents": ["d"] * 4}).status_code == 200
    message, _ = refused(http, "/v1/rerank", {"query": "q", "documents": ["d"] * 5}, 400, "documents")
    assert "documents has 5 items, over the limit of 4" in message


def test_the_content_parts_limit_is_validated():
    with pytest.raises(ValueError, match="max_content_parts"):
        GatewayConfig(pooling="h:1", max_content_parts=-1)
