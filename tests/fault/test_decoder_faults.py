"""A real decoder process behind the real gateway: an injected forward error, a clean restart, then a SIGTERM drain.

One decoder address, one model, so the gateway has no other replica to route to and every failure is
visible to the caller (routing around a failed replica is tests/gateway/test_routing.py). In order:

1. `--fault-fail-at-step`: the running stream ends with an error event, the decoder's health goes
   NOT_SERVING, the gateway's /ready goes 503 and new calls get 503, not a hang.
2. The failed process stops on SIGTERM with exit 0; a new one on the same port serves, and the gateway
   (never restarted) answers again.
3. SIGTERM with a stream in flight: the stream completes, new calls are refused while it drains, and the
   process exits 0 within its --drain-seconds.

A decoder killed mid-stream (SIGKILL) is tests/gateway/test_generation.py
(test_backend_dying_mid_stream_ends_with_an_error_event); a client that disconnects mid-stream is
test_client_disconnect_mid_stream_aborts_the_request there, and with an adapter in
tests/gateway/test_routing.py.
"""
from __future__ import annotations

import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.conftest import free_port
from tests.decoder.server.conftest import tiny_chat_model  # noqa: F401 - the fixture, shared with the decoder
from tests.gateway.fleet import GatewayThread, python_module, stop, wait_http, wait_serving
from tests.gateway.test_generation import events

MODEL = "tiny-chat"
DECODER = "tessera.decoder.v1.DecoderService"
DRAIN_S = 20
ADMIN_KEY = "sk-faults-admin-key"
CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}], "temperature": 0}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_chat_model):  # noqa: F811 - pytest injects the imported fixture
    logs = tmp_path_factory.mktemp("decoder-faults")
    port = free_port()

    def start(name: str, *extra: str):
        return python_module("services.decoder", [
            "--model", str(tiny_chat_model), "--served-model-name", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--num-blocks", "1024", "--block-size", "4", "--max-num-batched-tokens", "32",
            "--max-model-len", "4096", "--threads", "1", "--max-loras", "0", "--drain-seconds", str(DRAIN_S),
            *extra], logs / f"{name}.log")

    address = f"127.0.0.1:{port}"
    procs = [start("faulty", "--fault-fail-at-step", "40")]
    try:
        wait_serving(address, DECODER, procs[0])
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(address,), model_refresh_s=0.5,
                            admin_key=ADMIN_KEY)
        with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
            yield {"http": http, "procs": procs, "start": start, "address": address}
    finally:
        for proc in procs:
            stop(proc)


def health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=DECODER),
                                                              timeout=2)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_injected_forward_error_then_clean_restart(fleet):
    http, faulty = fleet["http"], fleet["procs"][0]
    started = time.monotonic()
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 500, "stream": True}) as reply:
        assert reply.status_code == 200
        got = events(reply.iter_lines())
    assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == "internal", got[-3:]
    assert time.monotonic() - started < 30   # an error, not a hang
    # The engine reports the failure before the streams hear of it; the health servicer's update is
    # a task of its own, so allow it a moment on a loaded machine.
    deadline = time.monotonic() + 5
    while health(fleet["address"]) != "NOT_SERVING":
        assert time.monotonic() < deadline, "still SERVING after the engine failed"
        time.sleep(0.05)
    ready = http.get("/ready", headers={"Authorization": f"Bearer {ADMIN_KEY}"})   # the admin sees why
    assert ready.status_code == 503 and "NOT_SERVING" in ready.text, ready.text
    refused = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable", refused.text

    # The failed process still stops cleanly, and a new one on the same port is picked up by the same gateway.
    faulty.send_signal(signal.SIGTERM)
    assert faulty.wait(DRAIN_S + 10) == 0
    fresh = fleet["start"]("restarted")
    fleet["procs"].append(fresh)
    wait_serving(fleet["address"], DECODER, fresh)
    wait_http(http.base_url.join("/ready").__str__(), timeout=30)
    reply = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


def test_sigterm_drains_the_stream_in_flight_then_exits_0(fleet):
    """Runs on the restarted decoder of the test above."""
    http, proc = fleet["http"], fleet["procs"][-1]
    assert proc.poll() is None
    with grpc.insecure_channel(fleet["address"]) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        call = stub.Generate(decoder_pb2.GenerateRequest(text="a long one", sampling=decoder_pb2.SamplingParams(
            temperature=0, max_tokens=1500, ignore_eos=True)), timeout=60)
        first = next(call)
        assert first.token_ids
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while health(fleet["address"]) == "SERVING":   # draining reads as not ready at once
            assert time.monotonic() < deadline, "still SERVING after SIGTERM"
            time.sleep(0.05)
        # New work is refused while the stream drains (through the gateway: 503, no hang).
        refused = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        rest = list(call)   # the stream in flight runs to its end
    tokens = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
    assert tokens == 1500 and rest[-2].finish_reason == decoder_pb2.FINISH_REASON_LENGTH
    assert rest[-1].usage.completion_tokens == 1500
    assert proc.wait(DRAIN_S + 5) == 0
    assert time.monotonic() - signalled < DRAIN_S + 5
