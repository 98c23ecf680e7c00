"""Adapters loaded by name through the gateway: a decoder with --lora-on-demand behind the real gateway.

The gateway lists no such adapter before its first request; a chat naming a folder under the decoder's
--lora-root is routed to that decoder's base model (GetModelInfo.lora_on_demand), loaded there, answered
with the adapter's own output (the same on a second call, now warm); a name with no folder is a 404 naming `model`.
"""
from __future__ import annotations

import httpx
import pytest

from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.decoder.lora.adapters import Spec, write_adapter
from tests.gateway.fleet import GatewayThread, python_module, stop, wait_serving

MODEL = "tiny-chat"
DECODER = "tessera.decoder.v1.DecoderService"
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_chat_model):
    tmp = tmp_path_factory.mktemp("on-demand")
    write_adapter(tiny_chat_model, tmp / "root", Spec("cold", 4, 8.0, ("q_proj", "v_proj"), 43), scale=0.5)
    port = free_port()
    proc = python_module("services.decoder", [
        "--model", str(tiny_chat_model), "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--threads", "1", "--lora-root", str(tmp / "root"), "--lora-on-demand"], tmp / "decoder.log")
    try:
        wait_serving(f"127.0.0.1:{port}", DECODER, proc)
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(f"127.0.0.1:{port}",))
        with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
            yield http
    finally:
        stop(proc)


def test_an_unlisted_adapter_folder_is_loaded_by_name_through_the_gateway(gateway):
    listed = {m["id"] for m in gateway.get("/v1/models").json()["data"]}
    assert "cold" not in listed
    base = gateway.post("/v1/chat/completions", json={**CHAT, "model": MODEL})
    cold = gateway.post("/v1/chat/completions", json={**CHAT, "model": "cold"})
    assert base.status_code == cold.status_code == 200, cold.text
    assert cold.json()["model"] == "cold"
    # A random rank-4 adapter on q/v moves the tiny model's greedy tokens off the base model's.
    assert cold.json()["choices"][0]["message"] != base.json()["choices"][0]["message"]
    again = gateway.post("/v1/chat/completions", json={**CHAT, "model": "cold"})
    assert again.json()["choices"][0]["message"] == cold.json()["choices"][0]["message"]


def test_a_name_without_a_folder_is_404_naming_model(gateway):
    reply = gateway.post("/v1/chat/completions", json={**CHAT, "model": "no-such-adapter"})
    assert reply.status_code == 404, reply.text
    err = reply.json()["error"]
    assert err["param"] == "model" and "no-such-adapter" in err["message"]
