"""Contract test: the pooling service over real gRPC on an ephemeral port, with health,
reflection, every RPC and every error code; the server keeps answering afterwards."""
from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common import tensors
from services.common.errors import REASON_KEY
from services.common.pb import pooling_pb2, pooling_pb2_grpc
from tests.pooling.conftest import TINY_SHAPE, RunningServer
from tests.tolerance import assert_close, assert_cosine

pb = pooling_pb2
TEXTS = ["A man is eating food.", "Hi there", "The new movie is awesome."]


@pytest.fixture(scope="module")
def matryoshka_dir(tmp_path_factory, tiny_st_dir):
    """The tiny sentence-transformers folder, declaring it was trained for 16 dimensions."""
    folder = tmp_path_factory.mktemp("tiny-matryoshka") / "m"
    shutil.copytree(tiny_st_dir, folder)
    path = folder / "config_sentence_transformers.json"
    cfg = json.loads(path.read_text())
    cfg["matryoshka_dimensions"] = [16]
    path.write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def server(matryoshka_dir, tiny_reranker_dir):
    running = RunningServer(embedding_model=str(matryoshka_dir), embedding_name="tiny-embed",
                            reranker_model=str(tiny_reranker_dir), reranker_name="tiny-rerank",
                            max_request_inputs=8)
    yield running
    running.close()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)


def text_inputs(texts):
    return [pb.EmbedInput(text=t) for t in texts]


def expect_error(call, request, code, reason=None, match=""):
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    err = info.value
    assert err.code() == code, err.details()
    assert match in err.details()
    if reason:
        assert dict(err.trailing_metadata())[REASON_KEY] == reason
    return err


@pytest.mark.numerics
def test_embed_matches_sentence_transformers_and_counts_tokens(stub, matryoshka_dir):
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer
    reply = stub.Embed(pb.EmbedRequest(inputs=text_inputs(TEXTS)), timeout=30)
    vectors = tensors.from_proto(reply.embeddings, dtype=torch.float32, shape=(3, 32))
    ref = torch.as_tensor(SentenceTransformer(str(matryoshka_dir), device="cpu").encode(TEXTS))
    assert_cosine(vectors, ref, **TINY_SHAPE)
    tok = Tokenizer.from_file(str(matryoshka_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    counts = [len(tok.encode(t).ids) for t in TEXTS]
    assert reply.model == "tiny-embed"
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(counts)
    # Token-id inputs give the same vectors as the text they encode.
    ids = [pb.EmbedInput(tokens=pb.TokenIds(ids=tok.encode(t).ids)) for t in TEXTS]
    by_ids = tensors.from_proto(stub.Embed(pb.EmbedRequest(inputs=ids), timeout=30).embeddings)
    assert_close(by_ids, vectors, **TINY_SHAPE)


@pytest.mark.numerics
def test_concurrent_requests_equal_single_results(stub):
    single = [tensors.from_proto(stub.Embed(pb.EmbedRequest(inputs=text_inputs([t])), timeout=30).embeddings)[0]
              for t in TEXTS]
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda t: stub.Embed(pb.EmbedRequest(inputs=text_inputs([t])), timeout=30),
                                TEXTS * 4))
    for i, reply in enumerate(replies):
        assert_close(tensors.from_proto(reply.embeddings)[0], single[i % 3], **TINY_SHAPE, what=f"request {i}")


def test_timeline_only_when_traced_and_in_stage_order(stub):
    assert not stub.Embed(pb.EmbedRequest(inputs=text_inputs(TEXTS)), timeout=30).HasField("timeline")
    before = time.monotonic_ns()
    reply = stub.Embed(pb.EmbedRequest(inputs=text_inputs(TEXTS), trace=True), timeout=30)
    after = time.monotonic_ns()
    t = reply.timeline
    # CLOCK_MONOTONIC in the service, so it brackets inside the caller's own readings.
    assert before <= t.received_ns <= t.queued_ns <= t.forward_start_ns < t.forward_end_ns <= t.resumed_ns \
        <= t.replied_ns <= after
    assert 1 <= t.batch_size <= 8


def test_matryoshka_dimensions_only_when_declared(stub):
    reply = stub.Embed(pb.EmbedRequest(inputs=text_inputs(TEXTS), dimensions=16), timeout=30)
    vectors = tensors.from_proto(reply.embeddings)
    assert vectors.shape == (3, 16) and vectors.shape[-1] == 16
    assert_close(vectors.norm(dim=-1), torch.ones(3), k=16)
    expect_error(stub.Embed, pb.EmbedRequest(inputs=text_inputs(TEXTS), dimensions=8),
                 grpc.StatusCode.INVALID_ARGUMENT, "UNSUPPORTED", "dimensions=8 is refused")


def test_truncate_opt_in(stub):
    long_text = "word " * 200          # over the folder's 64-token limit
    expect_error(stub.Embed, pb.EmbedRequest(inputs=text_inputs([long_text])),
                 grpc.StatusCode.INVALID_ARGUMENT, "CONTEXT_LENGTH", "over the model's 64")
    reply = stub.Embed(pb.EmbedRequest(inputs=text_inputs([long_text]), truncate=True), timeout=30)
    assert reply.usage.prompt_tokens == 64


@pytest.mark.numerics
def test_rerank_sorted_top_n_and_raw_scores(stub, tiny_reranker_dir):
    from sentence_transformers import CrossEncoder
    query, docs = "what is a panda?", ["The giant panda is a bear.", "Paris is in France.", "hi", "bamboo"]
    reply = stub.Rerank(pb.RerankRequest(query=query, documents=docs), timeout=30)
    ref = CrossEncoder(str(tiny_reranker_dir), device="cpu").predict([(query, d) for d in docs])
    assert [r.index for r in reply.results] == sorted(range(4), key=lambda i: -ref[i])
    assert_close([r.relevance_score for r in reply.results], sorted(ref, reverse=True), **TINY_SHAPE)
    assert reply.model == "tiny-rerank" and reply.usage.total_tokens > 0
    top = stub.Rerank(pb.RerankRequest(query=query, documents=docs, top_n=2, raw_scores=True), timeout=30)
    assert [r.index for r in top.results] == [r.index for r in reply.results][:2]
    raw = torch.tensor([r.relevance_score for r in top.results])
    assert_close(torch.sigmoid(raw), [r.relevance_score for r in reply.results[:2]], k=1)


def test_model_info(stub):
    models = {m.name: m for m in stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).models}
    embed, rerank = models["tiny-embed"], models["tiny-rerank"]
    assert embed.kind == pb.MODEL_KIND_EMBEDDING and embed.dimensions == 32
    assert (embed.pooling, embed.normalize, list(embed.matryoshka_dimensions)) == ("cls", True, [16])
    assert embed.max_model_len == 64 and embed.max_batch_size == 8
    assert rerank.kind == pb.MODEL_KIND_RERANK and rerank.activation == "sigmoid"
    # The packed BERT forward's fast paths: the matmul path per weight shape, and the attention (the C++
    # operator or the grouped SDPA, whichever timed faster at load); the reranker runs transformers' forward, and
    # its plan says so.
    choices = {c.name: c for c in embed.execution_plan.choices}
    assert any(name.startswith("linear ") for name in choices)
    assert choices["encoder_attention"].chosen in ("cpp", "torch")
    assert {t.candidate for t in choices["encoder_attention"].timings} == {"cpp", "torch"}
    [forward] = rerank.execution_plan.choices
    assert (forward.name, forward.chosen) == ("forward", "transformers") and "embedding models only" in forward.reason


BAD_EMBEDS = [
    (pb.EmbedRequest(model="nope", inputs=text_inputs(["x"])), grpc.StatusCode.NOT_FOUND, "not served"),
    (pb.EmbedRequest(model="tiny-rerank", inputs=text_inputs(["x"])), grpc.StatusCode.INVALID_ARGUMENT,
     "is a rerank model; call Rerank"),
    (pb.EmbedRequest(), grpc.StatusCode.INVALID_ARGUMENT, "inputs is empty"),
    (pb.EmbedRequest(inputs=text_inputs(["x"] * 9)), grpc.StatusCode.INVALID_ARGUMENT, "over the limit of 8"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput()]), grpc.StatusCode.INVALID_ARGUMENT, "neither text nor tokens"),
    (pb.EmbedRequest(inputs=text_inputs(["ok", ""])), grpc.StatusCode.INVALID_ARGUMENT, "inputs[1] is an empty"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(tokens=pb.TokenIds())]), grpc.StatusCode.INVALID_ARGUMENT,
     "no token ids"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(tokens=pb.TokenIds(ids=[101, -3]))]),
     grpc.StatusCode.INVALID_ARGUMENT, "token id -3 is outside"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(tokens=pb.TokenIds(ids=[101, 30522]))]),
     grpc.StatusCode.INVALID_ARGUMENT, "token id 30522 is outside"),
    (pb.EmbedRequest(inputs=[pb.EmbedInput(tokens=pb.TokenIds(ids=[7] * 65))]),
     grpc.StatusCode.INVALID_ARGUMENT, "65 tokens"),
]
BAD_RERANKS = [
    (pb.RerankRequest(model="tiny-embed", query="q", documents=["d"]), grpc.StatusCode.INVALID_ARGUMENT,
     "is a embedding model; call Embed"),
    (pb.RerankRequest(model="nope", query="q", documents=["d"]), grpc.StatusCode.NOT_FOUND, "not served"),
    (pb.RerankRequest(query="q"), grpc.StatusCode.INVALID_ARGUMENT, "documents is empty"),
    (pb.RerankRequest(query="", documents=["d"]), grpc.StatusCode.INVALID_ARGUMENT, "query is empty"),
    (pb.RerankRequest(query="q", documents=["d", ""]), grpc.StatusCode.INVALID_ARGUMENT, "documents[1]"),
    (pb.RerankRequest(query="q", documents=["d"], top_n=0), grpc.StatusCode.INVALID_ARGUMENT, "top_n"),
    (pb.RerankRequest(query="q", documents=["d"], top_n=2), grpc.StatusCode.INVALID_ARGUMENT, "top_n"),
    (pb.RerankRequest(query="q", documents=["d"] * 9), grpc.StatusCode.INVALID_ARGUMENT, "over the limit"),
]


@pytest.mark.parametrize("request_, code, match", BAD_EMBEDS)
def test_embed_errors(stub, request_, code, match):
    expect_error(stub.Embed, request_, code, match=match)


@pytest.mark.parametrize("request_, code, match", BAD_RERANKS)
def test_rerank_errors(stub, request_, code, match):
    expect_error(stub.Rerank, request_, code, match=match)


def test_still_serving_after_errors_and_metrics_recorded(stub, server):
    reply = stub.Embed(pb.EmbedRequest(inputs=text_inputs(["still here"])), timeout=30)
    assert tuple(reply.embeddings.shape) == (1, 32)
    registry = server.handle.metrics.registry
    assert registry.get_sample_value("tessera_pooling_batch_size_count", {"model": "tiny-embed"}) > 0
    assert registry.get_sample_value("tessera_pooling_request_seconds_count",
                                     {"rpc": "Embed", "code": "INVALID_ARGUMENT"}) > 0
    assert registry.get_sample_value("tessera_pooling_queue_depth", {"model": "tiny-embed"}) == 0


def test_health_reflection_no_reranker_and_overload(tiny_bert_dir):
    """A second server: NOT_SERVING while loading, then SERVING; reflection; no reranker;
    a full queue answers RESOURCE_EXHAUSTED and the server recovers."""
    running = RunningServer(wait=False, embedding_model=str(tiny_bert_dir), max_request_inputs=4,
                            max_queue=4, max_wait_ms=400)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            service = "tessera.pooling.v1.PoolingService"
            first = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert first == health_pb2.HealthCheckResponse.NOT_SERVING
            running.wait_loaded()
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING

            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]), timeout=10))
            names = {s.name for s in answer.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names

            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            expect_error(stub.Rerank, pb.RerankRequest(query="q", documents=["d"]),
                         grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", "no reranker is configured")
            # Four sequences fill the queue and wait (400 ms hold) for company; one more is refused.
            held = stub.Embed.future(pb.EmbedRequest(inputs=text_inputs(["a", "b", "c", "d"])), timeout=30)
            time.sleep(0.1)
            expect_error(stub.Embed, pb.EmbedRequest(inputs=text_inputs(["e"])),
                         grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", "is full")
            assert tuple(held.result().embeddings.shape) == (4, 32)
            assert tuple(stub.Embed(pb.EmbedRequest(inputs=text_inputs(["e"])), timeout=30)
                         .embeddings.shape) == (1, 32)
    finally:
        running.close()
