"""Clients that never read, and keys that take every place (gateway/limits.py), over real sockets: a decoder
subprocess on the tiny chat model behind a real gateway whose connections have a small SO_SNDBUF (so a stalled
client fills the server's buffers after ~70 KB instead of megabytes). Each stalled client is a raw socket with
a tiny receive buffer that sends a streaming chat and never calls recv (it only peeks at the status line).

And the bounded queue between the decoder's streams and the response (gateway/generation.py), with fake
streams: a reader that stops stops the pulling, and many calls' messages still all arrive, in order.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import REGISTRY

from gateway.config import GatewayConfig
from gateway.generation import QUEUE_PER_CALL, Generation
from gateway.limits import per_key_limit
from services.common.pb import decoder_pb2
from tests.conftest import free_port
from tests.decoder.idle import stats, wait_idle
from tests.gateway.chat_fleet import chat_fleet
from tests.gateway.fleet import GatewayThread

KEYS = ("sk-slow-tenant-a", "sk-slow-tenant-b", "sk-slow-tenant-c")
LIMIT = 16          # --max-concurrent-requests; with three keys each key may hold half of it
SEND_TIMEOUT_S = 3.0  # long enough that opening LIMIT streams on a busy machine cuts none of them first
SEND_BUFFER = 4096
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
# ~1.5 KB per event (20 top logprobs): the gateway's buffers are full after ~50 tokens, long before the end.
STALLED = {"messages": HELLO, "stream": True, "max_tokens": 400, "ignore_eos": True, "logprobs": True,
           "top_logprobs": 20}
QUICK = {"messages": HELLO, "max_tokens": 2}


def gateway_cfg(port: int, address: str, **fields) -> GatewayConfig:
    return GatewayConfig(host="127.0.0.1", port=port, decoder=(address,), api_key=",".join(KEYS),
                         max_concurrent_requests=LIMIT, **fields)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_chat_model):
    """The decoder has KV blocks for LIMIT streams of STALLED at once."""
    with chat_fleet(tiny_chat_model, tmp_path_factory.mktemp("slow"), ("--num-blocks", "2048"),
                    gateway={"api_key": ",".join(KEYS), "max_concurrent_requests": LIMIT,
                             "send_timeout_s": SEND_TIMEOUT_S}, send_buffer=SEND_BUFFER) as f:
        yield f


def stall(url: str, key: str, **fields) -> socket.socket:
    """A raw client that sends STALLED (fields over it) and never reads; returned once the gateway has answered
    200 (the request holds its places)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: it sets the TCP window
    sock.settimeout(30)
    sock.connect((host, int(port)))
    body = json.dumps({**STALLED, **fields}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    head = b""
    while len(head) < 12:
        head = sock.recv(12, socket.MSG_PEEK)  # peeking leaves the bytes in the receive buffer
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def chat(url: str, key: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=QUICK, headers={"Authorization": f"Bearer {key}"},
                      timeout=30)


def timeouts() -> float:
    return REGISTRY.get_sample_value("tessera_gateway_send_timeouts_total") or 0.0


def test_clients_that_never_read_are_cut_and_free_their_places(fleet):
    """LIMIT stalled streams (half under key a, half under key b) lock a third key out; once the send timeout
    has cut them, a normal chat answers again and the decoder holds nothing (no request, no KV block)."""
    url, before = fleet["url"], timeouts()
    with contextlib.ExitStack() as held:
        for i in range(LIMIT):
            held.enter_context(stall(url, KEYS[i % 2]))
            if i == 0:
                first = time.monotonic()   # no place can free before this + SEND_TIMEOUT_S
        refused = chat(url, KEYS[2])
        assert refused.status_code == 429 and "concurrent requests" in refused.json()["error"]["message"]
        while (reply := chat(url, KEYS[2])).status_code == 429:
            assert time.monotonic() - first < 60, "the stalled streams never gave their places back"
            time.sleep(0.2)
        assert reply.status_code == 200, reply.text
        waited = time.monotonic() - first
        # The decoder's running requests drop back: every stalled call cancelled or finished, its blocks freed.
        idle = wait_idle(fleet["stub"], timeout=30)
        assert idle.free_blocks == idle.total_blocks
        # Each stream is cut SEND_TIMEOUT_S after its own sends stalled, and a fast decoder has finished every
        # stalled call by the time the first is cut: so the count is waited for, not read once.
        deadline = time.monotonic() + SEND_TIMEOUT_S + 20
        while timeouts() - before < LIMIT and time.monotonic() < deadline:
            time.sleep(0.1)
    assert timeouts() - before == LIMIT
    assert SEND_TIMEOUT_S <= waited < SEND_TIMEOUT_S + 20, waited


def test_a_client_that_pauses_between_reads_is_not_cut(fleet):
    """A client that reads 64 KiB, then reads nothing for 0.6 x the send timeout, and again, for a stream that
    lasts longer than the timeout: it would be cut if the timeout bounded the whole stream or any pause. It
    bounds one blocked send, which each burst unblocks (taking the ~48 KiB between uvicorn's high- and
    low-water marks)."""
    before = timeouts()
    with contextlib.closing(stall(fleet["url"], KEYS[2], max_tokens=120)) as sock:
        received, started = b"", time.monotonic()
        while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            time.sleep(SEND_TIMEOUT_S * 0.6)
            burst = len(received) + 65536
            sock.settimeout(0.5)
            with contextlib.suppress(TimeoutError):
                while len(received) < burst and (chunk := sock.recv(65536)):
                    received += chunk
            assert timeouts() == before, "a client that reads was cut"
            assert time.monotonic() - started < 60, received[-300:]
        assert time.monotonic() - started > SEND_TIMEOUT_S
    assert received.count(b'"top_logprobs"') >= 120
    wait_idle(fleet["stub"], timeout=30)


def test_a_key_at_its_limit_gets_429_while_another_gets_through(fleet):
    """Three keys and a limit of 16: each key may hold 8 (half, the default). A gateway on the same decoder
    with a long send timeout, so the stalled clients hold their places until they close."""
    assert per_key_limit(None, LIMIT, len(KEYS)) == LIMIT // 2
    cfg = gateway_cfg(free_port(), fleet["address"], send_timeout_s=120.0)
    with GatewayThread(cfg, SEND_BUFFER) as gw:
        with contextlib.ExitStack() as held:
            for _ in range(LIMIT // 2):
                held.enter_context(stall(gw.url, KEYS[0]))
            refused = chat(gw.url, KEYS[0])
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1" and refused.headers["x-request-id"]
            error = refused.json()["error"]
            assert error["code"] == "overloaded" and "this API key" in error["message"], error
            other = chat(gw.url, KEYS[1])
            assert other.status_code == 200, other.text
            assert stats(fleet["stub"]).running >= 1   # key a's streams are still there
        # Closing the sockets is a disconnect: key a's places come back.
        deadline = time.monotonic() + 20
        while (again := chat(gw.url, KEYS[0])).status_code == 429:
            assert time.monotonic() < deadline, "key a's places were never given back"
            time.sleep(0.1)
        assert again.status_code == 200, again.text
    wait_idle(fleet["stub"], timeout=30)


def test_per_key_limit_rule_and_config():
    assert per_key_limit(None, 256, 1) == 0       # one key is every caller: the global limit is its limit
    assert per_key_limit(None, 256, 0) == 0
    assert per_key_limit(None, 256, 3) == 128
    assert per_key_limit(None, 0, 3) == 0         # no global limit: no derived one
    assert per_key_limit(5, 256, 1) == 5 and per_key_limit(0, 256, 3) == 0
    k1, k2 = KEYS[:2]
    cfg = GatewayConfig(decoder=("h:1",), api_key=f" {k1}, {k2} ")
    assert cfg.api_keys == (k1, k2)
    for bad in (f"{k1},,{k2}", f"{k1},{k1}", ""):
        with pytest.raises(ValueError, match="api_key"):
            GatewayConfig(decoder=("h:1",), api_key=bad)
    with pytest.raises(ValueError, match="admin_key"):
        GatewayConfig(decoder=("h:1",), api_key=f"{k1},{k2}", admin_key=k2)
    with pytest.raises(ValueError, match="send_timeout_s"):
        GatewayConfig(decoder=("h:1",), send_timeout_s=-1)


class FakeStreams:
    """Backend and route for Generation: every call streams `length` messages per choice (None: without end),
    choice by choice in turn, text = the message's number; `pulled` counts messages taken from the streams."""

    label = "fake"
    decoder = SimpleNamespace(Generate=None)

    def __init__(self, n: int, length: int | None):
        self.n, self.length, self.pulled = n, length, 0

    def stream(self, method, request, request_id, fields):
        async def messages():
            step = 0
            while self.length is None or step < self.length * self.n:
                self.pulled += 1
                await asyncio.sleep(0)  # a real stream waits on the network between messages
                yield decoder_pb2.GenerateResponse(index=step % self.n, text=str(step // self.n), token_ids=[1])
                step += 1
        return messages()

    async def candidates(self, key):
        return [self]

    def failed(self, backend):
        pass

    def answered(self, backend, key):
        pass


def generation(streams: FakeStreams, calls: int) -> Generation:
    requests = [decoder_pb2.GenerateRequest(text=f"prompt {i}") for i in range(calls)]
    return Generation(streams, requests, "rid", streams.n)


def test_a_reader_that_stops_stops_the_pulling():
    """Nothing reads the generation: its calls' pumps stop once the queue is full, instead of buffering all
    the decoder generates."""
    async def run():
        streams = FakeStreams(n=2, length=None)
        g = generation(streams, calls=3)
        await g.start()
        try:
            await asyncio.sleep(0.2)
            # Each call: QUEUE_PER_CALL queued, its first message, and one held by the pump waiting on put.
            assert streams.pulled <= 3 * (QUEUE_PER_CALL + 2), streams.pulled
            got = 0
            async for _ in g:
                got += 1
                if got == 200:
                    break
            assert streams.pulled >= 200   # reading again resumes the pulling
        finally:
            await g.aclose()
    asyncio.run(run())


def test_many_calls_and_choices_all_arrive_in_order_through_the_bound():
    """4 prompts x n=3 choices x 100 messages each, far past the queue's bound, read by a slow reader and
    collected whole: every choice gets all its messages, each in order."""
    async def run(slow: bool):
        streams = FakeStreams(n=3, length=100)
        g = generation(streams, calls=4)
        await g.start()
        texts: list[list[str]] = [[] for _ in range(g.num_choices)]
        try:
            if slow:
                async for index, delta in g:
                    texts[index].append(delta.text)
                    await asyncio.sleep(0)
            else:
                texts = [c.text for c in await g.collect()]
        finally:
            await g.aclose()
        assert texts == [[str(i) for i in range(100)]] * 12
    asyncio.run(asyncio.wait_for(run(slow=True), 30))
    asyncio.run(asyncio.wait_for(run(slow=False), 30))
