"""x-tessera-trace on /v1/embeddings: a traced request's stage stamps, in the order the stages happen, only
when the gateway runs with --trace-requests and the caller asks (bench/pooling.py (c) reads them)."""
from __future__ import annotations

import time

import httpx
import pytest

from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.gateway.fleet import GatewayThread
from tests.pooling.conftest import RunningServer, minilm_dir, tiny_bert_dir  # noqa: F401 - fixtures

ORDER = ["gateway_received", "gateway_sent", "received", "queued", "forward_start", "forward_end", "resumed",
         "replied", "gateway_replied", "gateway_encoded"]


@pytest.fixture(scope="module")
def pooling(tiny_bert_dir):  # noqa: F811 - the imported fixture
    running = RunningServer(embedding_model=str(tiny_bert_dir), embedding_name="tiny")
    yield running
    running.close()


def gateway(pooling, trace: bool) -> GatewayThread:
    return GatewayThread(GatewayConfig(host="127.0.0.1", port=free_port(), pooling=f"127.0.0.1:{pooling.port}",
                                       trace_requests=trace))


def test_traced_request_gets_its_stamps_in_stage_order(pooling):
    with gateway(pooling, True) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        before = time.monotonic_ns()
        reply = http.post("/v1/embeddings", json={"input": ["one", "two"]}, headers={"x-tessera-trace": "1"})
        after = time.monotonic_ns()
        assert reply.status_code == 200, reply.text
        pairs = (part.partition("=") for part in reply.headers["x-tessera-trace"].split(","))
        stamps = {k: int(v) for k, _, v in pairs}
        assert list(stamps) == [*ORDER, "batch_size"]
        times = [stamps[name] for name in ORDER]
        assert before <= times[0] and times == sorted(times) and times[-1] <= after
        assert stamps["batch_size"] == 2
        untraced = http.post("/v1/embeddings", json={"input": "one"})
        assert untraced.status_code == 200 and "x-tessera-trace" not in untraced.headers


def test_no_stamps_unless_the_gateway_allows_tracing(pooling):
    with gateway(pooling, False) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        reply = http.post("/v1/embeddings", json={"input": "one"}, headers={"x-tessera-trace": "1"})
        assert reply.status_code == 200 and "x-tessera-trace" not in reply.headers
