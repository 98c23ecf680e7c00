"""A forward that raises: its requests fail with an error, health goes NOT_SERVING, nothing leaks."""
from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import decoder_pb2 as D
from services.common.pb import decoder_pb2_grpc
from tests.loops import LoopThread


@pytest.fixture
def failing_server(tiny_chat_model):
    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.decoder.server.service import start
    loop = LoopThread()
    cfg = DecoderConfig(model=str(tiny_chat_model), num_blocks=64, block_size=4, max_num_batched_tokens=32,
                        max_loras=0, fault_fail_at_step=4, fast_paths="screen=on")
    server, servicer = loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0), cfg))
    yield f"127.0.0.1:{server.port}"
    loop.run(server.stop(0))
    assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()


def test_injected_forward_error_fails_requests_and_reports_not_serving(failing_server):
    with grpc.insecure_channel(failing_server) as ch:
        stub = decoder_pb2_grpc.DecoderServiceStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == serving
        long = D.GenerateRequest(text="a long one", sampling=D.SamplingParams(temperature=0, max_tokens=50,
                                                                              ignore_eos=True))
        streams = [stub.Generate(long), stub.Generate(long)]
        codes = []
        for call in streams:
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            codes.append(info.value.code())
        assert set(codes) <= {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE}
        assert grpc.StatusCode.INTERNAL in codes     # the step's own requests carry the error
        deadline = time.time() + 10
        while health.Check(health_pb2.HealthCheckRequest(service="")).status == serving:
            assert time.time() < deadline, "health never left SERVING"
            time.sleep(0.05)
        stats = stub.GetModelInfo(D.GetModelInfoRequest()).stats
        assert stats.free_blocks == stats.total_blocks and stats.running == 0 and stats.waiting == 0
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(D.GenerateRequest(text="hi", sampling=D.SamplingParams(max_tokens=2))))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
