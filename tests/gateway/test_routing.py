"""Routing across decoder replicas (gateway/routing.py) with two real decoder processes serving one tiny model.

In order, on one fleet: calls spread by outstanding requests; adapter affinity orders a replica with the
adapter resident first (its ListAdapters says so); /ready stays 200 with one replica dead; a replica
killed mid-stream ends that stream with an error event and nothing is retried after the first token; a
new call whose first choice is the dead replica is retried on the live one before its first token.
"""
from __future__ import annotations

import time

import grpc
import httpx
import pytest

from gateway.backends import GENERATION, Backend, Catalog
from gateway.config import GatewayConfig
from gateway.routing import Router
from services.common.pb import decoder_pb2, decoder_pb2_grpc
from tests.conftest import free_port
from tests.decoder.lora.adapters import Spec, write_adapter
from tests.gateway.fleet import GatewayThread, LoopThread, python_module, stop, wait_serving
from tests.gateway.test_generation import events

MODEL = "tiny-chat"
DECODER = "tessera.decoder.v1.DecoderService"
ADMIN_KEY = "sk-routing-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Long enough that a stream is still running seconds after it starts (the tiny model is fast).
LONG = {"messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 8000, "temperature": 0,
        "stream": True}


def start_decoder(model, port: int, log, *extra: str):
    return python_module("services.decoder", [
        "--model", str(model), "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--num-blocks", "4096", "--block-size", "4", "--max-num-batched-tokens", "32", "--max-model-len", "8192",
        "--threads", "1", *extra], log)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_chat_model):
    tmp = tmp_path_factory.mktemp("routing")
    adapter = write_adapter(tiny_chat_model, tmp / "adapters", Spec("a1", 4, 8.0, ("q_proj", "v_proj"), 41))
    ports = [free_port(), free_port()]
    procs = [start_decoder(tiny_chat_model, ports[0], tmp / "r0.log"),
             start_decoder(tiny_chat_model, ports[1], tmp / "r1.log", "--lora", f"a1={adapter}")]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    try:
        for address, proc in zip(addresses, procs, strict=True):
            wait_serving(address, DECODER, proc)
        cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=tuple(addresses), admin_key=ADMIN_KEY)
        with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
            yield {"http": http, "procs": procs, "addresses": addresses, "cfg": cfg, "app": gw.server.config.app}
    finally:
        for proc in procs:
            stop(proc)


def stats(address: str):
    with grpc.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        return stub.GetModelInfo(decoder_pb2.GetModelInfoRequest(), timeout=5).stats


def admitted(addresses: list[str]) -> list[int]:
    """Prompt tokens each replica has looked up in its prefix cache so far: grows by a prompt per call served."""
    return [stats(a).prefix_queries for a in addresses]


def first_events(reply, count: int):
    """Read count SSE data lines; return the line iterator to go on with (hold it: when it is garbage
    collected, httpx closes the response, which the gateway rightly sees as the client leaving)."""
    lines = reply.iter_lines()
    seen = 0
    for line in lines:
        seen += line.startswith("data: ")
        if seen == count:
            return lines
    pytest.fail("the stream ended early")


def test_streams_spread_by_outstanding_requests(replicas):
    http, addresses = replicas["http"], replicas["addresses"]
    before = admitted(addresses)
    with http.stream("POST", "/v1/chat/completions", json=LONG) as one:
        held = first_events(one, 2)  # keep the iterator: dropping it closes the response (a disconnect)
        with http.stream("POST", "/v1/chat/completions", json=LONG) as two:
            held2 = first_events(two, 2)
            after = admitted(addresses)
            del held, held2
    # One call each: the second went to the replica with nothing outstanding, not to the first in line again.
    grown = [a - b for a, b in zip(after, before, strict=True)]
    assert grown[0] > 0 and grown[0] == grown[1], (before, after)


def test_prefix_affinity_follows_the_replica_that_served_the_prompt_start(replicas):
    """A call whose prompt starts as an earlier one's goes where that one went (its KV blocks are cached
    there), though ties by load would pick the first replica; another prompt start does not follow."""
    http, addresses = replicas["http"], replicas["addresses"]
    system = "You are a careful assistant who answers in one short sentence. " * 6     # > PREFIX_CHARS

    def chat(question: str) -> None:
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "max_tokens": 2, "temperature": 0}
        assert http.post("/v1/chat/completions", json=body).status_code == 200

    with http.stream("POST", "/v1/chat/completions", json=LONG) as busy:
        held = first_events(busy, 2)        # replica 0 carries a stream: the first call goes to replica 1
        before = admitted(addresses)
        chat("What is 2 + 2?")
        after = admitted(addresses)
        del held
    assert after[0] == before[0] and after[1] > before[1], (before, after)
    before = admitted(addresses)
    for question in ("What is 3 + 3?", "Name a colour.", "Say hello."):
        chat(question)                     # both replicas idle now: the prompt start decides
    after = admitted(addresses)
    assert after[0] == before[0] and after[1] > before[1], (before, after)
    body = {"messages": [{"role": "user", "content": "A short question without a shared start?"}], "max_tokens": 2}
    before = admitted(addresses)
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    after = admitted(addresses)
    assert after[0] > before[0] and after[1] == before[1], (before, after)


def test_adapter_affinity_prefers_the_resident_replica(replicas):
    loop = LoopThread()
    cfg = replicas["cfg"]

    async def order():
        backends = [Backend("decoder", a, cfg) for a in replicas["addresses"]]
        for b in backends:
            b.open()
        try:
            catalog = Catalog(backends, 60)
            await catalog.refresh(0)
            router = Router(catalog)
            plain = router.route(await catalog.resolve(MODEL, GENERATION))
            lora = router.route(await catalog.resolve("a1", GENERATION))
            # Chosen once, by the router: both routes hold every replica of the base model.
            assert [b.address for b in plain.replicas] == [b.address for b in lora.replicas] == replicas["addresses"]
            # Load the adapter's replica with a real outstanding stream: plain calls avoid it, a1 still wants it.
            stream = backends[1].stream(backends[1].decoder.Generate, decoder_pb2.GenerateRequest(
                model=MODEL, text="go on", sampling=decoder_pb2.SamplingParams(max_tokens=3000, ignore_eos=True)),
                "affinity")
            await anext(stream)
            try:
                got = ([b.address for b in await plain.candidates()],
                       [b.address for b in await lora.candidates()],
                       router.residency.slots)
                assert (await plain.best()).address == got[0][0] and (await lora.best()).address == got[1][0]
            finally:
                await stream.aclose()
            return got
        finally:
            for b in backends:
                await b.close()

    try:
        plain, lora, slots = loop.run(order())
    finally:
        loop.close()
    r0, r1 = replicas["addresses"]
    assert slots[f"decoder@{r1}"]["a1"] >= 0 and "a1" not in slots[f"decoder@{r0}"]
    assert plain == [r0, r1]   # fewest outstanding first
    assert lora == [r1, r0]    # resident adapter beats load; the other replica is the fallback


def test_concurrency_limit_answers_429_with_retry_after(replicas):
    """A second gateway on the same replicas with --max-concurrent-requests 1 (gateway/limits.py)."""
    cfg = GatewayConfig(host="127.0.0.1", port=free_port(), decoder=tuple(replicas["addresses"]),
                        max_concurrent_requests=1)
    with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=LONG) as busy:
            held = first_events(busy, 2)  # a stream holds its place until it ends
            refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1" and refused.headers["x-request-id"]
            assert refused.json()["error"]["code"] == "overloaded"
            assert http.get("/ready").status_code == 200   # probes are never limited
            del held
        # The place frees once the gateway has seen the client leave and cancelled the stream.
        deadline = time.time() + 10
        while (reply := http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 429:
            assert time.time() < deadline, "the place of the closed stream was never given back"
            time.sleep(0.05)
        assert reply.status_code == 200, reply.text


def test_disconnect_with_an_adapter_returns_blocks_and_adapter_refs(replicas):
    """A client that leaves mid-stream of an adapter request: the replica's free KV blocks and adapter leases
    return to idle. At the gRPC level: the gateway's adapter routing (model = adapter name) is another change."""
    address = replicas["addresses"][1]
    with grpc.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        sampling = decoder_pb2.SamplingParams(max_tokens=3000, ignore_eos=True)
        call = stub.Generate(decoder_pb2.GenerateRequest(adapter="a1", text="go on", sampling=sampling), timeout=60)
        next(call)
        busy = stats(address)
        assert busy.adapter_refs == 1 and busy.free_blocks < busy.total_blocks
        call.cancel()
        deadline = time.time() + 10
        while (idle := stats(address)).adapter_refs or idle.free_blocks != idle.total_blocks or idle.running:
            assert time.time() < deadline, f"not back to idle: {idle}"
            time.sleep(0.05)


def test_one_replica_dead_mid_stream_then_retry_before_first_token(replicas):
    """Kills replica 1: its stream ends with an error event (no retry after the first token), while a new call
    that tries replica 1 first (replica 0 is busier) is retried on replica 0 and answered."""
    http, (p0, p1) = replicas["http"], replicas["procs"]
    with http.stream("POST", "/v1/chat/completions", json=LONG) as on0:
        held = first_events(on0, 2)  # keep the iterator: dropping it closes the response (a disconnect)
        with http.stream("POST", "/v1/chat/completions", json=LONG) as on1:
            lines = first_events(on1, 2)
            assert [stats(a).running for a in replicas["addresses"]] == [1, 1]
            p1.kill()
            p1.wait(10)
            rest = events(lines)
        assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "unavailable", rest[-3:]
        # Nothing after the error: the stream was not resumed or restarted on replica 0.
        assert stats(replicas["addresses"][0]).running == 1
        # Replica 0 is busier (the stream above), so replica 1 is first in line: dead, UNAVAILABLE, retried.
        reply = http.post("/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] in ("length", "stop")
        # It was tried there first and refused: the router now tries replica 1 last.
        assert f"decoder@{replicas['addresses'][1]}" in replicas["app"].state.router.failed_at
        ready = http.get("/ready", headers=ADMIN)   # the admin key sees each replica's state
        assert ready.status_code == 200, ready.text   # the model still has a SERVING replica
        assert "UNREACHABLE" in ready.json()["backends"][f"decoder@{replicas['addresses'][1]}"]
        del held
    p0.kill()
    p0.wait(10)
    reply = http.post("/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 3})
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable", reply.text
    # Every replica dead: the error names the service, never an address nor gRPC's words about the connection.
    assert "decoder" in reply.text and "127.0.0.1" not in reply.text and "ipv4" not in reply.text, reply.text
    ready = http.get("/ready", headers=ADMIN)
    assert ready.status_code == 503 and f"model {MODEL}" in ready.json()["error"]["message"], ready.text
    ready = http.get("/ready")
    assert ready.status_code == 503 and "127.0.0.1" not in ready.text and MODEL not in ready.text, ready.text
