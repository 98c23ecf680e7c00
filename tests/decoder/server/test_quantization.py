"""--quantization int8 over real gRPC: the flag, GetModelInfo, the gateway's model card, and
greedy streams that run to completion and leave the engine idle."""
from __future__ import annotations

import grpc
import pytest

from services.common import config as cfg_mod
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from services.decoder.server.config import ENV_PREFIX, DecoderConfig, DecoderServerConfig
from tests.decoder.idle import wait_idle
from tests.decoder.server.test_contract import chat
from tests.loops import LoopThread

D = decoder_pb2


@pytest.fixture(scope="module")
def quantized(tiny_chat_model):
    """A real decoder started from the command line with --quantization int8: (stub, address). Without
    prefix caching: a repeated prompt's cached prefix would leave its last tokens to the few-row kernel
    (int8 blocks of 32) where the first run computed them by the many-row int8 matmul, and the random
    tiny model's near-tied logits can then tell the two roundings apart."""
    from services.decoder.server.service import start
    server_cfg, cfg = cfg_mod.load((DecoderServerConfig, DecoderConfig),
                                   ["--model", str(tiny_chat_model), "--quantization", "int8", "--port", "0",
                                    "--host", "127.0.0.1", "--num-blocks", "64", "--block-size", "4",
                                    "--no-enable-prefix-caching"],
                                   prog="decoder", description="", env_prefix=ENV_PREFIX)
    loop = LoopThread()
    server, servicer = loop.run(start(server_cfg, cfg))
    address = f"127.0.0.1:{server.port}"
    with grpc.insecure_channel(address) as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel), address
    loop.run(server.stop(0))
    assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()


def test_model_info_and_the_gateway_report_it(quantized):
    from gateway.backends import Backend
    from gateway.config import GatewayConfig
    stub, address = quantized
    info = stub.GetModelInfo(D.GetModelInfoRequest())
    # Every projection of the tiny model has a width that is a multiple of 16, the LM head too.
    assert info.quantization.startswith("int8: ") and info.quantization.split()[1] == info.quantization.split()[3]
    plan = {c.name: c for c in info.execution_plan.choices}
    assert (plan["linear"].chosen, plan["linear"].reason) == ("none", "every linear is quantized")
    assert any(name.startswith("gemv ") for name in plan)
    # The many-row int8 matmul per shape, with the times it was chosen from.
    assert all(plan[name].timings for name in plan if name.startswith("int8_gemm "))
    assert any(name.startswith("int8_gemm ") for name in plan)

    async def card():
        backend = Backend("decoder", address, GatewayConfig(decoder=(address,)))
        backend.open()
        try:
            return (await backend.models())[0].extra["quantization"]
        finally:
            await backend.close()

    loop = LoopThread()
    try:
        assert loop.run(card()) == info.quantization
    finally:
        loop.close()


def test_greedy_streams_complete_and_repeat(quantized):
    stub, _ = quantized
    runs = []
    for _ in range(2):
        msgs = list(stub.Generate(chat("Count with me: one two three", temperature=0, max_tokens=16,
                                       ignore_eos=True)))
        runs.append([t for m in msgs for t in m.token_ids])
        assert msgs[-1].usage.completion_tokens == 16
    assert len(runs[0]) == 16 and runs[0] == runs[1]
    wait_idle(stub)


def test_bad_quantization_is_a_usage_error_at_start(capsys):
    with pytest.raises(SystemExit) as info:
        cfg_mod.load((DecoderServerConfig, DecoderConfig), ["--model", "/m", "--quantization", "int3"],
                     prog="decoder", description="", env_prefix=ENV_PREFIX)
    assert info.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err
