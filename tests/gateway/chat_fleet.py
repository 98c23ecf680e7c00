"""One decoder subprocess on a chat model (by default the tiny one: SmolLM2's tokenizer and template, random
weights) behind a real gateway, for the gateway test modules that need generation, and what they check it by:
`wait_idle` (the engine holds nothing) and `still_up` (idle, and a plain request is still answered)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import grpc

from gateway.config import GatewayConfig
from services.common.pb import decoder_pb2_grpc
from tests.conftest import free_port
from tests.decoder import idle
from tests.gateway.fleet import GatewayThread, clients, python_module, stop, wait_serving

KEY = "sk-chat-tenant-key"
MODEL = "tiny-chat"
MAX_LEN = 1024


@contextlib.contextmanager
def chat_fleet(model_folder: Path, logs: Path, extra_args: tuple[str, ...] = (), gateway: dict | None = None,
               send_buffer: int | None = None):
    """Yields {"url", "client" (openai), "http" (httpx with the key), "stub" (the decoder's gRPC stub),
    "decoder" (its process), "address" (its HOST:PORT), "logs"}. extra_args go to the decoder after the
    defaults (a flag given again wins); gateway: GatewayConfig fields over the defaults (api_key None: no key);
    send_buffer: the gateway's SO_SNDBUF (tests/gateway/fleet.py GatewayThread)."""
    port = free_port()
    decoder = python_module("services.decoder", [
        "--model", str(model_folder), "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--num-blocks", "512", "--block-size", "4", "--max-num-batched-tokens", "64", "--max-n", "4",
        "--max-model-len", str(MAX_LEN), "--threads", "1", *extra_args], logs / "decoder.log")
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, "tessera.decoder.v1.DecoderService", decoder)
        cfg = GatewayConfig(**{"host": "127.0.0.1", "port": free_port(), "decoder": (address,), "api_key": KEY,
                               **(gateway or {})})
        with GatewayThread(cfg, send_buffer) as gw, grpc.insecure_channel(address) as channel, \
                clients(gw.url, cfg.api_keys[0] if cfg.api_keys else None) as served:
            yield {**served, "stub": decoder_pb2_grpc.DecoderServiceStub(channel), "decoder": decoder, "logs": logs,
                   "address": address}
    finally:
        stop(decoder)


def wait_idle(fleet: dict, timeout: float = 20) -> None:
    """The engine holds nothing: no request running or waiting, every KV block free."""
    idle.wait_idle(fleet["stub"], timeout)


def still_up(fleet: dict) -> None:
    """Idle, and a normal request still succeeds."""
    wait_idle(fleet)
    reply = fleet["http"].post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    wait_idle(fleet)
