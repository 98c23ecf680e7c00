"""Closed-loop load for the pooling benchmarks: `clients` concurrent callers in one asyncio loop, each
sending one single-text embedding request after another, over gRPC (PoolingService.Embed) or HTTP/1.1
(POST /v1/embeddings on a keep-alive connection per caller).

The HTTP caller is a few lines over asyncio streams rather than httpx: at 64 callers and some
hundreds of requests per second httpx costs the load generator more CPU than the server under test
spends on the HTTP layer, and on a two-core machine that CPU is taken from the server. Every
server here is measured with the same caller, so its cost is the same on each side.

With trace=True each reply's stage stamps (x-tessera-trace, EmbedResponse.timeline) are kept with
the caller's own send and receive times; `stages` turns them into per-stage durations.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import grpc

from services.common.pb import pooling_pb2, pooling_pb2_grpc


@dataclass
class Load:
    """What one run measured: wall seconds, per-request latencies (s), failures, traced stamps."""

    seconds: float
    latencies: list[float]
    errors: int = 0
    traces: list[dict[str, int]] = field(default_factory=list)
    example_error: str = ""

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def line(self) -> str:
        return (f"{self.rate:.1f} req/s, p50 {self.percentile(0.5) * 1000:.1f} ms, "
                f"p99 {self.percentile(0.99) * 1000:.1f} ms, {self.errors} errors")


async def _run(clients: int, texts: list[str], call) -> Load:
    """Run call(worker_state, text) -> trace dict | None for every text, `clients` at a time."""
    latencies, traces, errors = [], [], []

    async def caller(mine: list[str]):
        for text in mine:
            t0 = time.monotonic_ns()
            try:
                stamps = await call(text)
            except (OSError, grpc.RpcError, ValueError) as exc:
                errors.append(repr(exc))
                continue
            t1 = time.monotonic_ns()
            latencies.append((t1 - t0) / 1e9)
            if stamps is not None:
                traces.append({"client_sent": t0, **stamps, "client_received": t1})
    start = time.perf_counter()
    await asyncio.gather(*(caller(texts[i::clients]) for i in range(clients)))
    return Load(time.perf_counter() - start, latencies, len(errors), traces, errors[0] if errors else "")


async def grpc_load(port: int, texts: list[str], clients: int, trace: bool = False) -> Load:
    """Single-text Embed calls straight to the pooling service."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)

        async def call(text):
            reply = await stub.Embed(pooling_pb2.EmbedRequest(inputs=[pooling_pb2.EmbedInput(text=text)],
                                                              trace=trace), timeout=600)
            if reply.embeddings.shape[0] != 1:
                raise ValueError(f"{reply.embeddings.shape[0]} rows for one input")
            if not trace:
                return None
            t = reply.timeline
            return {"received": t.received_ns, "queued": t.queued_ns, "forward_start": t.forward_start_ns,
                    "forward_end": t.forward_end_ns, "resumed": t.resumed_ns, "replied": t.replied_ns,
                    "batch_size": t.batch_size}
        for text in texts[:4]:   # warm: the channel is up and the first forwards are behind us
            await call(text)
        return await _run(clients, texts, call)


class HttpConnection:
    """One keep-alive HTTP/1.1 connection: POST a JSON body, read the status, headers and body."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post(self, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(data)}\r\n{extra}\r\n".encode() + data)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        fields = {}
        for line in head[1:]:
            if line:
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.strip()
        if fields.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                chunks.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            await self.reader.readuntil(b"\r\n")
            payload = b"".join(chunks)
        else:
            payload = await self.reader.readexactly(int(fields.get("content-length", "0")))
        if fields.get("connection", "").lower() == "close":
            await self.close()
        return status, fields, payload

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


def _body(model: str, value) -> dict:
    """An embeddings request body; an empty model name leaves `model` out (the server's default)."""
    return {"model": model, "input": value} if model else {"input": value}


def _stamps(header: str) -> dict[str, int]:
    return {k: int(v) for k, _, v in (part.partition("=") for part in header.split(","))}


async def http_load(port: int, texts: list[str], clients: int, model: str, trace: bool = False) -> Load:
    """Single-text POST /v1/embeddings (OpenAI's shape, float output), one connection per caller."""
    pool = [HttpConnection("127.0.0.1", port) for _ in range(clients)]
    free = list(pool)
    headers = {"x-tessera-trace": "1"} if trace else {}

    async def call(text):
        conn = free.pop()
        try:
            status, fields, payload = await conn.post("/v1/embeddings", _body(model, text), headers)
        except (OSError, asyncio.IncompleteReadError):
            await conn.close()
            raise
        finally:
            free.append(conn)
        if status != 200:
            raise ValueError(f"HTTP {status}: {payload[:200]!r}")
        data = json.loads(payload)["data"]
        if len(data) != 1 or not data[0]["embedding"]:
            raise ValueError(f"{len(data)} embeddings for one input")
        return _stamps(fields["x-tessera-trace"]) if trace else None
    try:
        for text in texts[:4]:
            await call(text)
        return await _run(clients, texts, call)
    finally:
        for conn in pool:
            await conn.close()


async def http_vectors(port: int, model: str, texts: list[str]) -> list[list[float]]:
    """Embeddings of texts in one request (checks a peer's vectors against ours)."""
    conn = HttpConnection("127.0.0.1", port)
    try:
        status, _, payload = await conn.post("/v1/embeddings", _body(model, texts))
    finally:
        await conn.close()
    if status != 200:
        raise SystemExit(f"HTTP {status} from 127.0.0.1:{port}: {payload[:300]!r}")
    return [row["embedding"] for row in sorted(json.loads(payload)["data"], key=lambda r: r["index"])]


# Consecutive stamps -> the stage between them. Stages whose stamps a trace lacks are skipped
# (gRPC straight to the service has no gateway_* stamps).
STAGES = (
    ("http in", "client_sent", "gateway_received"),
    ("gateway before call", "gateway_received", "gateway_sent"),
    ("grpc to service", "gateway_sent", "received"),
    ("grpc to service", "client_sent", "received"),
    ("tokenise", "received", "queued"),
    ("queue wait", "queued", "forward_start"),
    ("forward", "forward_start", "forward_end"),
    ("loop wake-up", "forward_end", "resumed"),
    ("reply build", "resumed", "replied"),
    ("grpc back", "replied", "gateway_replied"),
    ("grpc back", "replied", "client_received"),
    ("gateway JSON", "gateway_replied", "gateway_encoded"),
    ("http out", "gateway_encoded", "client_received"),
    ("total", "client_sent", "client_received"),
)


def stages(traces: list[dict[str, int]]) -> dict[str, list[float]]:
    """Per-stage durations in seconds over traced requests, in timeline order."""
    out: dict[str, list[float]] = {}
    if not traces:
        return out
    keys = traces[0].keys()
    for name, a, b in STAGES:
        if a in keys and b in keys and name not in out:
            out[name] = [(t[b] - t[a]) / 1e9 for t in traces]
    return out


def stage_table(traces: list[dict[str, int]]) -> list[str]:
    """Lines: stage, p50, p99 and mean in ms."""
    lines = []
    for name, values in stages(traces).items():
        ordered = sorted(values)
        p50, p99 = (ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 for q in (0.5, 0.99))
        lines.append(f"    {name:<20} p50 {p50:8.2f} ms   p99 {p99:8.2f} ms   "
                     f"mean {sum(values) / len(values) * 1000:8.2f} ms")
    sizes = sorted(t["batch_size"] for t in traces)
    lines.append(f"    {'batch size':<20} p50 {sizes[len(sizes) // 2]:8d}      p1 {sizes[len(sizes) // 100]:8d}")
    return lines
