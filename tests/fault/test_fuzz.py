"""Fuzz the gateway with schemathesis against its own /openapi.json, on a real fleet (tiny decoder and pooling
processes): for a bounded number of cases per operation, with a fixed seed, no answer may be a 500 (a bug),
and every error must be OpenAI's error object. 503/504 are allowed: a backend may be busy or slow."""
from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from gateway.config import GatewayConfig
from tests.conftest import free_port
from tests.decoder.server.conftest import tiny_chat_model  # noqa: F401 - the fixture, shared with the decoder
from tests.gateway.fleet import GatewayThread, python_module, stop, wait_serving
from tests.pooling.conftest import minilm_dir, tiny_bert_dir  # noqa: F401 - fixtures shared with the pooling tests

EXAMPLES_PER_OPERATION = 30
TOTAL_BUDGET_S = 150


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory, tiny_chat_model, tiny_bert_dir):  # noqa: F811 - pytest injects the fixtures
    logs = tmp_path_factory.mktemp("fuzz")
    ports = {"decoder": free_port(), "pooling": free_port()}
    procs = [
        python_module("services.decoder", [
            "--model", str(tiny_chat_model), "--served-model-name", "tiny-chat", "--host", "127.0.0.1",
            "--port", str(ports["decoder"]), "--num-blocks", "512", "--block-size", "4",
            "--max-num-batched-tokens", "64", "--threads", "1"], logs / "decoder.log"),
        python_module("services.pooling", [
            "--embedding-model", str(tiny_bert_dir), "--embedding-name", "tiny-bert", "--host", "127.0.0.1",
            "--port", str(ports["pooling"])], logs / "pooling.log"),
    ]
    try:
        wait_serving(f"127.0.0.1:{ports['decoder']}", "tessera.decoder.v1.DecoderService", procs[0])
        wait_serving(f"127.0.0.1:{ports['pooling']}", "tessera.pooling.v1.PoolingService", procs[1])
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=(f"127.0.0.1:{ports['decoder']}",),
                            pooling=f"127.0.0.1:{ports['pooling']}", grpc_timeout_s=10, generate_timeout_s=20)
        with GatewayThread(cfg) as gw:
            yield gw.url
    finally:
        for proc in procs:
            stop(proc)


def test_no_500_for_any_generated_request(gateway_url):
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    bad: list[str] = []
    ran: dict[str, int] = {}
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        ran[label] = 0
        check = _checker(operation, label, gateway_url, ran, bad)
        check()
        assert time.monotonic() - started < TOTAL_BUDGET_S, f"fuzzing took over {TOTAL_BUDGET_S}s (ran {ran})"
    assert len(ran) >= 6 and all(ran.values()), ran
    assert not bad, "\n".join(bad[:10])
    assert httpx.get(f"{gateway_url}/ready", timeout=10).status_code == 200   # and the fleet is still up


def _checker(operation, label: str, gateway_url: str, ran: dict, bad: list):
    """A hypothesis test of one operation (a fixed seed: derandomize), recording bad answers in `bad`."""

    @settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def check(case):
        ran[label] += 1
        response = case.call(base_url=gateway_url, timeout=30)
        if response.status_code == 500 or (response.status_code >= 400 and "error" not in _json(response)):
            bad.append(f"{label} -> {response.status_code}: {response.text[:300]} for body "
                       f"{str(case.body)[:300]} query {case.query} path {case.path_parameters}")
    return check


def _json(response) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
