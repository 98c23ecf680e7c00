"""The backend token on a real decoder server (services/common/auth.py): LoadAdapter, Generate and reflection
without it or with a wrong one get UNAUTHENTICATED and change nothing, as does a method the server lacks;
the gateway's Backend, holding it, is served; grpc.health.v1 answers everyone."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.backends import Backend
from gateway.config import GatewayConfig
from services.common.auth import call_metadata, new_token, write_token
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.decoder.lora.adapters import Spec, write_adapter
from tests.loops import LoopThread

D = decoder_pb2
PROMPT = D.TokenIds(ids=list(range(100, 111)))


@pytest.fixture(scope="module")
def guarded(tiny_chat_model, tmp_path_factory):
    """A decoder that needs the token, reflection on: yields (address, token file, the token, adapter root)."""
    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.decoder.server.service import start
    tmp = tmp_path_factory.mktemp("auth")
    token_file = write_token(tmp / "backend.token")
    root = tmp / "adapters"
    write_adapter(tiny_chat_model, root, Spec("other", 4, 8.0, ("q_proj",), 41), scale=0.5)
    loop = LoopThread()
    cfg = DecoderConfig(model=str(tiny_chat_model), num_blocks=64, block_size=4, max_num_batched_tokens=32,
                        max_loras=2, max_lora_rank=8, lora_root=str(root), fast_paths="screen=on")
    server, servicer = loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0, reflection=True,
                                                          backend_token_file=str(token_file)), cfg))
    yield f"127.0.0.1:{server.port}", token_file, token_file.read_text().strip(), root
    loop.run(server.stop(0))
    assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()


def calls(stub, channel, metadata, root):
    """Each guarded RPC once with metadata -> its status code (OK when it answered)."""
    def code(fn):
        try:
            fn()
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    return {
        "Generate": code(lambda: list(stub.Generate(D.GenerateRequest(token_ids=PROMPT, sampling=D.SamplingParams(
            temperature=0, max_tokens=2, ignore_eos=True)), metadata=metadata))),
        "LoadAdapter": code(lambda: stub.LoadAdapter(D.LoadAdapterRequest(name="pirate", path=str(root / "other")),
                                                      metadata=metadata)),
        "ListAdapters": code(lambda: stub.ListAdapters(D.ListAdaptersRequest(), metadata=metadata)),
        "reflection": code(lambda: next(reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata))),
    }


@pytest.mark.parametrize("metadata", [(), call_metadata(new_token()), (("authorization", "Basic x"),)],
                         ids=["none", "wrong-token", "not-bearer"])
def test_calls_without_the_token_are_refused_and_change_nothing(guarded, metadata):
    address, _, token, root = guarded
    with grpc.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        assert set(calls(stub, channel, metadata, root).values()) == {grpc.StatusCode.UNAUTHENTICATED}
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListAdapters(D.ListAdaptersRequest(), metadata=metadata)
        assert "backend token" in refused.value.details() and token not in refused.value.details()
        names = {a.name for a in stub.ListAdapters(D.ListAdaptersRequest(), metadata=call_metadata(token)).adapters}
        assert "pirate" not in names     # the refused LoadAdapter loaded nothing
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_method_the_server_lacks_is_refused_alike_without_the_token(guarded):
    """Without the token an unknown method (or reflection on a server without --reflection) is UNAUTHENTICATED,
    as an existing one is, so a caller cannot list what the server has; with it, UNIMPLEMENTED."""
    address, _, token, _ = guarded
    with grpc.insecure_channel(address) as channel:
        for method in ("/tessera.decoder.v1.DecoderService/NoSuchMethod", "/no.such.Service/Call"):
            unary, stream = channel.unary_unary(method), channel.stream_stream(method)
            for metadata, expected in (((), grpc.StatusCode.UNAUTHENTICATED),
                                       (call_metadata(new_token()), grpc.StatusCode.UNAUTHENTICATED),
                                       (call_metadata(token), grpc.StatusCode.UNIMPLEMENTED)):
                with pytest.raises(grpc.RpcError) as refused:
                    unary(b"", metadata=metadata, timeout=10)
                assert refused.value.code() == expected, (method, metadata)
                with pytest.raises(grpc.RpcError) as refused:
                    list(stream(iter([b""]), metadata=metadata, timeout=10))
                assert refused.value.code() == expected, (method, metadata)


def test_the_token_is_served(guarded):
    address, _, token, root = guarded
    with grpc.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        assert set(calls(stub, channel, call_metadata(token), root).values()) == {grpc.StatusCode.OK}
        stub.UnloadAdapter(D.UnloadAdapterRequest(name="pirate"), metadata=call_metadata(token))


def test_the_gateway_sends_the_token(guarded):
    """gateway/backends.py: discovery (unary) and a generation (stream) with --backend-token-file; without it
    the same backend is refused."""
    address, token_file, _, _ = guarded

    async def use(cfg):
        backend = Backend("decoder", address, cfg)
        backend.open()
        try:
            models = await backend.models()
            request = D.GenerateRequest(token_ids=PROMPT, sampling=D.SamplingParams(temperature=0, max_tokens=3,
                                                                                     ignore_eos=True))
            replies = [r async for r in backend.stream(backend.decoder.Generate, request, "auth-test")]
            return [m.name for m in models], replies[-1].usage.completion_tokens
        finally:
            await backend.close()

    loop = LoopThread()
    try:
        names, tokens = loop.run(use(GatewayConfig(decoder=(address,), backend_token_file=str(token_file))))
        assert names and tokens == 3
        with pytest.raises(Exception) as refused:
            loop.run(use(GatewayConfig(decoder=(address,))))
        assert "backend token" in str(refused.value)
    finally:
        loop.close()
