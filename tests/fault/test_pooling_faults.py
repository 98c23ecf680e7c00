"""Faults inside the pooling service's forward, over real gRPC (services/pooling/batcher.py, failure policy).

1. `--fault-fail-at-forward` in a real process: the worker failure answers the call in the forward INTERNAL
   and every other call UNAVAILABLE, never a hang; health reads NOT_SERVING on every name; new Embed and
   Rerank calls fail fast with UNAVAILABLE; SIGTERM still exits 0.
2. A forward that refuses its input (ValueError, or a typed error) fails only that call; the in-process
   server stays SERVING and answers the next call.
"""
from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import REASON_KEY, InvalidArgument
from services.common.pb import pooling_pb2, pooling_pb2_grpc
from tests.conftest import free_port
from tests.gateway.fleet import python_module, stop, wait_serving
from tests.pooling.conftest import RunningServer, minilm_dir, tiny_bert_dir, tiny_reranker_dir  # noqa: F401

POOLING = "tessera.pooling.v1.PoolingService"
pb = pooling_pb2


def embed_request(text: str = "a cat sat on the mat") -> pb.EmbedRequest:
    return pb.EmbedRequest(inputs=[pb.EmbedInput(text=text)])


def health(channel: grpc.Channel, service: str) -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def outcome(call) -> tuple[str, str]:
    """(status code name, tessera reason) of a finished call future."""
    try:
        call.result()
    except grpc.RpcError as exc:
        return exc.code().name, dict(exc.trailing_metadata() or ()).get(REASON_KEY, "")
    return "OK", ""


def test_worker_failure_goes_not_serving_and_fails_fast(tmp_path, tiny_bert_dir, tiny_reranker_dir):  # noqa: F811
    port = free_port()
    address = f"127.0.0.1:{port}"
    # One sequence per forward: forwards 1 and 2 serve the first two calls, forward 3 fails.
    proc = python_module("services.pooling", [
        "--embedding-model", str(tiny_bert_dir), "--reranker-model", str(tiny_reranker_dir), "--host", "127.0.0.1",
        "--port", str(port), "--max-batch-size", "1", "--threads", "1", "--drain-seconds", "2",
        "--fault-fail-at-forward", "3"], tmp_path / "pooling.log")
    try:
        wait_serving(address, POOLING, proc)
        with grpc.insecure_channel(address) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            for _ in range(2):
                assert tuple(stub.Embed(embed_request(), timeout=30).embeddings.shape) == (1, 32)
            started = time.monotonic()
            calls = [stub.Embed.future(embed_request(f"sentence {i}"), timeout=30) for i in range(6)]
            outcomes = [outcome(c) for c in calls]
            assert time.monotonic() - started < 10, "an error, not a hang"
            # The one in the failed forward: INTERNAL; the queued ones (or those that came after): UNAVAILABLE.
            assert sorted(outcomes) == [("INTERNAL", "INTERNAL")] + [("UNAVAILABLE", "UNAVAILABLE")] * 5, outcomes
            # The batcher awaits the health update before failing any call: no polling needed.
            assert [health(channel, name) for name in ("", POOLING)] == ["NOT_SERVING", "NOT_SERVING"]
            rerank = pb.RerankRequest(query="q", documents=["d"])
            for call, request in ((stub.Embed, embed_request()), (stub.Rerank, rerank)):
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as info:
                    call(request, timeout=30)
                assert time.monotonic() - started < 2
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
                assert "stopped serving after a failed forward" in info.value.details()
                assert "injected fault at forward 3" in info.value.details()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def server(tiny_bert_dir):  # noqa: F811
    running = RunningServer(embedding_model=str(tiny_bert_dir), embedding_name="tiny-bert")
    batcher = running.handle.servicer.models["tiny-bert"].batcher
    run = batcher.run

    def refusing(seqs):
        # Token id 4242 / 4343 stand for input that slipped validation and that the model refuses.
        ids = {t for s in seqs for t in s.ids}
        if 4242 in ids:
            raise ValueError("index 4242 has no row in this table")
        if 4343 in ids:
            raise InvalidArgument("the model refused this input", param="inputs[0]")
        return run(seqs)
    batcher.run = refusing
    yield running
    running.close()


@pytest.mark.parametrize("token, code, match", [(4242, "INTERNAL", "could not run this batch: index 4242"),
                                                (4343, "INVALID_ARGUMENT", "the model refused this input")])
def test_refused_batch_fails_alone_and_the_service_keeps_serving(server, token, code, match):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        bad = pb.EmbedRequest(inputs=[pb.EmbedInput(tokens=pb.TokenIds(ids=[101, token, 102]))])
        with pytest.raises(grpc.RpcError) as info:
            stub.Embed(bad, timeout=30)
        assert info.value.code().name == code and match in info.value.details(), info.value.details()
        assert health(channel, POOLING) == "SERVING" and health(channel, "") == "SERVING"
        assert tuple(stub.Embed(embed_request(), timeout=30).embeddings.shape) == (1, 32)
    assert server.handle.servicer.models["tiny-bert"].batcher.failed is None
