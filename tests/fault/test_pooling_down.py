"""Kill the pooling service under the real gateway: 503 within the deadline, then recovery on its own once a new
pooling process serves on the same port (the gateway is never restarted or told)."""
from __future__ import annotations

import time

import httpx
import pytest

from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.gateway.fleet import GatewayThread, python_module, stop, wait_serving
from tests.pooling.conftest import minilm_dir, tiny_bert_dir  # noqa: F401 - fixtures shared with the pooling tests

POOLING = "tessera.pooling.v1.PoolingService"
DEADLINE_S = 5.0
EMBED = {"input": ["a cat sat on the mat", "the dog barked"], "model": "tiny-bert"}


def test_pooling_killed_503_within_deadline_then_recovers(tmp_path, tiny_bert_dir):  # noqa: F811
    port = free_port()
    address = f"127.0.0.1:{port}"

    def start(name: str):
        return python_module("services.pooling", [
            "--embedding-model", str(tiny_bert_dir), "--embedding-name", "tiny-bert", "--host", "127.0.0.1",
            "--port", str(port), "--drain-seconds", "2"], tmp_path / f"{name}.log")

    procs = [start("first")]
    try:
        wait_serving(address, POOLING, procs[0])
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), pooling=address, grpc_timeout_s=DEADLINE_S)
        with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
            ok = http.post("/v1/embeddings", json=EMBED)
            assert ok.status_code == 200, ok.text
            procs[0].kill()
            procs[0].wait(10)
            for _ in range(3):   # each answer is a prompt 503, never a hang past the deadline
                started = time.monotonic()
                down = http.post("/v1/embeddings", json=EMBED)
                assert time.monotonic() - started < DEADLINE_S + 1
                assert down.status_code == 503 and down.json()["error"]["code"] == "unavailable", down.text
            assert http.get("/ready").status_code == 503
            procs.append(start("second"))
            wait_serving(address, POOLING, procs[1])
            deadline = time.monotonic() + 20
            while (reply := http.post("/v1/embeddings", json=EMBED)).status_code != 200:
                assert reply.status_code == 503, reply.text
                if time.monotonic() > deadline:
                    pytest.fail(f"the gateway did not recover: {reply.text}")
                time.sleep(0.2)
            assert len(reply.json()["data"]) == 2 and http.get("/ready").status_code == 200
    finally:
        for proc in procs:
            stop(proc)
