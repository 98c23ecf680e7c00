"""Vision benchmark (a): Encode latency on a Redis feature-cache hit vs a miss, on real photos.

The bench writes a random-weight Qwen2-VL checkpoint whose vision tower has Qwen2-VL-2B's
width (embed 1280, 16 heads, MLP x4, merger to 1536) and its default preprocessing
(max_pixels 12845056, so a 512x512 photo is 36x36 patches -> 324 rows), but only --depth
blocks (default 4 of the real 32, to fit a 2-core machine: a miss would be ~8x slower at
full depth, which only improves the ratio). It starts a private redis-server on a free
port and the vision service as a subprocess, then times Encode through gRPC:
  miss: Redis flushed first -> hash, lookup, decode, preprocess, encode, store;
  hit:  the same bytes again -> hash, lookup, rows back.
Medians over --rounds per photo; the last line is the hit/miss ratio (goal <= 0.1x).

    python bench/vision.py [--depth 4] [--rounds 2] [--threads 0]
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import redis  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from services.common.pb import vision_pb2, vision_pb2_grpc  # noqa: E402
from tests.vision.checkpoints import write_qwen2_vl  # noqa: E402  (the same builder the tests use)

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg")
QWEN2_VL_2B_VISION = dict(embed_dim=1280, num_heads=16, mlp_ratio=4)
QWEN2_VL_2B_TEXT = dict(hidden_size=1536, intermediate_size=256, num_hidden_layers=1, num_attention_heads=12,
                        num_key_value_heads=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


def wait_serving(channel: grpc.Channel, proc: subprocess.Popen, seconds: float = 300) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vision service exited with {proc.returncode}")
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise RuntimeError("vision service never reported SERVING")


def timed(stub, data: bytes) -> tuple[float, bool]:
    start = time.perf_counter()
    out = stub.Encode(vision_pb2.EncodeRequest(images=[vision_pb2.ImageData(data=data)]), timeout=600)
    return time.perf_counter() - start, out.images[0].cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=4, help="vision blocks (Qwen2-VL-2B has 32)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads of the service; 0 = torch default")
    args = ap.parse_args()
    data_dir = Path(importlib.util.find_spec("skimage").origin).parent / "data"
    photos = {n: (data_dir / n).read_bytes() for n in PHOTOS}
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        sys.exit("redis-server is not installed")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_qwen2_vl(Path(tmp) / "qwen2-vl-2b-vision-random",
                              vision={**QWEN2_VL_2B_VISION, "depth": args.depth},
                              text=QWEN2_VL_2B_TEXT, mrope_section=(16, 24, 24), min_pixels=56 * 56,
                              max_pixels=28 * 28 * 16384, tokenizer=False, weight_std=0.02)
        rport, vport = free_port(), free_port()
        procs = [subprocess.Popen([redis_bin, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", tmp],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        try:
            wait_port(rport, procs[0])
            url = f"redis://127.0.0.1:{rport}/0"
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.vision", "--model", str(ckpt), "--port", str(vport),
                 "--host", "127.0.0.1", "--redis-url", url, "--threads", str(args.threads), "--log-level", "WARNING"],
                cwd=ROOT))
            with grpc.insecure_channel(f"127.0.0.1:{vport}", options=[
                    ("grpc.max_receive_message_length", 256 << 20)]) as channel:
                wait_serving(channel, procs[1])
                stub = vision_pb2_grpc.VisionServiceStub(channel)
                timed(stub, photos["chelsea.png"])  # warm-up (allocators, thread pools)
                flush = redis.Redis.from_url(url)
                miss: dict[str, list[float]] = {n: [] for n in photos}
                hit: dict[str, list[float]] = {n: [] for n in photos}
                for r in range(args.rounds):
                    flush.flushdb()
                    for name, data in photos.items():
                        seconds, cached = timed(stub, data)
                        assert not cached, "a miss was served from the cache"
                        miss[name].append(seconds)
                        for _ in range(3):
                            seconds, cached = timed(stub, data)
                            assert cached, "a repeat was not served from the cache"
                            hit[name].append(seconds)
                    print(f"round {r + 1}/{args.rounds} done", flush=True)
            for name in photos:
                m, h = statistics.median(miss[name]), statistics.median(hit[name])
                print(f"{name:14s} miss {m * 1000:8.1f} ms   hit {h * 1000:6.1f} ms   {h / m:.3f}x")
            m_all = statistics.median([v for vs in miss.values() for v in vs])
            h_all = statistics.median([v for vs in hit.values() for v in vs])
            print(f"vision (a) tower depth {args.depth}/32 at Qwen2-VL-2B width; median miss {m_all * 1000:.1f} ms, "
                  f"median hit {h_all * 1000:.1f} ms")
            print(f"vision ratios: (a) hit/miss {h_all / m_all:.3f}x (goal <= 0.1x)")
        finally:
            for proc in reversed(procs):
                proc.terminate()
                proc.wait(timeout=30)


if __name__ == "__main__":
    main()
