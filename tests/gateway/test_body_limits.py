"""Limits before work (gateway/edge.py): 400,000 one-word messages and a 12 MB embedding input are refused
with 413 and one line naming the config key, in well under a second and before any parsing, and the gateway
keeps answering; the exact message count is checked again once parsed (a key spelled with escapes)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.gateway.fleet import GatewayThread


@pytest.fixture(scope="module")
def gateway():
    # No backend listens at these addresses: every answer below comes from the gateway itself.
    cfg = GatewayConfig(port=free_port(), pooling="127.0.0.1:1", decoder=("127.0.0.1:1",), max_messages=64,
                        grpc_timeout_s=0.5, health_timeout_s=0.5)
    with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as client:
        yield client


def refused(client: httpx.Client, path: str, body: bytes) -> tuple[dict, float]:
    started = time.perf_counter()
    reply = client.post(path, content=body, headers={"content-type": "application/json"})
    took = time.perf_counter() - started
    assert reply.status_code == 413, reply.text[:500]
    error = reply.json()["error"]
    assert error["code"] == "too_large" and "\n" not in error["message"]
    return error, took


def test_four_hundred_thousand_messages_are_refused_before_parsing(gateway):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w"}] * 400_000}).encode()
    assert len(body) < GatewayConfig.max_body_bytes     # under the byte cap: the count refuses it
    error, took = refused(gateway, "/v1/chat/completions", body)
    assert "max_messages" in error["message"] and took < 1.0, (error, took)
    assert gateway.get("/health").status_code == 200


def test_a_twelve_megabyte_embedding_input_is_refused_at_once(gateway):
    body = json.dumps({"model": "m", "input": "word " * 2_400_000}).encode()
    error, took = refused(gateway, "/v1/embeddings", body)
    assert "max_text_body_bytes" in error["message"] and took < 1.0, (error, took)
    assert gateway.get("/health").status_code == 200


def test_text_mentioning_role_is_not_counted_and_escaped_keys_are_counted_once_parsed(gateway):
    quoted = json.dumps({"model": "m", "messages": [{"role": "user", "content": '"role" ' * 500}]}).encode()
    reply = gateway.post("/v1/chat/completions", content=quoted, headers={"content-type": "application/json"})
    assert reply.status_code != 413, reply.text[:300]      # past the edge (no decoder here: 5xx or 404)
    escaped = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w"}] * 65}).encode()
    escaped = escaped.replace(b'"role"', b'"\\u0072ole"')
    error, _ = refused(gateway, "/v1/chat/completions", escaped)
    assert "65 messages" in error["message"] and error["param"] == "messages"
    small = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w"}] * 64}).encode()
    reply = gateway.post("/v1/chat/completions", content=small, headers={"content-type": "application/json"})
    assert reply.status_code != 413, reply.text[:300]


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_text_body_bytes"):
        GatewayConfig(pooling="h:1", max_text_body_bytes=10)
    with pytest.raises(ValueError, match="max_messages"):
        GatewayConfig(pooling="h:1", max_messages=-1)
