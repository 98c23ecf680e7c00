"""Vision benchmarks: (a) Encode on a Redis feature-cache hit vs a miss; (b) TTFT of a repeated image chat vs cold.

Both write random-weight Qwen2-VL checkpoints whose vision tower has Qwen2-VL-2B's width (embed 1280, 16
heads, MLP x4, merger to 1536) and its default preprocessing (max_pixels 12845056, so a 512x512 photo is
36x36 patches -> 324 rows), but only --depth blocks (default 4 of the real 32, to fit a 2-core machine: a
miss would be ~8x slower at full depth, which only improves the ratios). Each starts a private
redis-server on a free port and the services as subprocesses.

(a) times Encode through gRPC on real photos:
  miss: Redis flushed first -> hash, lookup, decode, preprocess, encode, store;
  hit:  the same bytes again -> hash, lookup, rows back.
(b) adds a decoder on the same checkpoint (text model at Qwen2-VL-2B's width, --text-layers of its 28
  layers) and the gateway, and times the first streamed event of /v1/chat/completions (the gateway sends
  it once the decoder's first token arrives) with the official `openai` client:
  cold: a photo never seen (one pixel changed: a new content hash) -> vision miss, prefill of every
        image row (only the system prompt's blocks are a prefix hit);
  warm: the same image and prompt again -> feature-cache hit and a prefix-cache hit over the image.
Medians over --rounds per photo; the last line holds both ratios ((a) goal <= 0.1x; (b) reported).

    python bench/vision.py [--depth 4] [--text-layers 2] [--rounds 2] [--threads 0] [--part a|b|both]
"""
from __future__ import annotations

import argparse
import base64
import importlib.util
import io
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
from PIL import Image  # noqa: E402

from services.common.pb import vision_pb2, vision_pb2_grpc  # noqa: E402
from tests.vision.checkpoints import write_qwen2_vl  # noqa: E402  (the same builder the tests use)

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg")
QWEN2_VL_2B_VISION = dict(embed_dim=1280, num_heads=16, mlp_ratio=4)
QWEN2_VL_2B_TEXT = dict(hidden_size=1536, intermediate_size=256, num_hidden_layers=1, num_attention_heads=12,
                        num_key_value_heads=2)
# (b) runs the text model too: Qwen2-VL-2B's real widths, fewer layers.
QWEN2_VL_2B_TEXT_FULL = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                             max_position_embeddings=4096)



def summarize(slow: dict, fast: dict, slow_name: str, fast_name: str, title: str) -> float:
    """Print per-photo and overall medians (seconds in, ms out); return the fast/slow ratio of the medians."""
    for name in slow:
        s, f = statistics.median(slow[name]), statistics.median(fast[name])
        print(f"{name:14s} {slow_name} {s * 1000:8.1f} ms   {fast_name} {f * 1000:7.1f} ms   {f / s:.3f}x")
    s_all = statistics.median([v for vs in slow.values() for v in vs])
    f_all = statistics.median([v for vs in fast.values() for v in vs])
    print(f"{title}; median {slow_name} {s_all * 1000:.1f} ms, median {fast_name} {f_all * 1000:.1f} ms")
    return f_all / s_all

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
            raise RuntimeError(f"{proc.args[2]} exited with {proc.returncode}")
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.args[2]} never reported SERVING")


def timed(stub, data: bytes) -> tuple[float, bool]:
    start = time.perf_counter()
    out = stub.Encode(vision_pb2.EncodeRequest(images=[vision_pb2.ImageData(data=data)]), timeout=600)
    return time.perf_counter() - start, out.images[0].cached


def start_redis(tmp: str) -> tuple[subprocess.Popen, str]:
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        sys.exit("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_vision(ckpt: Path, url: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.vision", "--model", str(ckpt), "--port", str(port), "--host", "127.0.0.1",
         "--redis-url", url, "--threads", str(threads), "--log-level", "WARNING", "--insecure-no-auth"], cwd=ROOT)
    return proc, f"127.0.0.1:{port}"


def part_a(args, photos: dict[str, bytes], tmp: str) -> float:
    """Encode hit/miss; returns the median hit/miss ratio."""
    ckpt = write_qwen2_vl(Path(tmp) / "qwen2-vl-2b-vision-random",
                          vision={**QWEN2_VL_2B_VISION, "depth": args.depth},
                          text=QWEN2_VL_2B_TEXT, mrope_section=(16, 24, 24), min_pixels=56 * 56,
                          max_pixels=28 * 28 * 16384, tokenizer=False, weight_std=0.02)
    procs = []
    try:
        rproc, url = start_redis(tmp)
        procs.append(rproc)
        vproc, address = start_vision(ckpt, url, args.threads)
        procs.append(vproc)
        with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)]) as channel:
            wait_serving(channel, vproc)
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
                print(f"(a) round {r + 1}/{args.rounds} done", flush=True)
    finally:
        stop_all(procs)
    return summarize(miss, hit, "miss", "hit",
                     f"vision (a) tower depth {args.depth}/32 at Qwen2-VL-2B width")


def variant(data: bytes, k: int) -> bytes:
    """The photo with one pixel changed: the same size (the same prompt length), a new content hash."""
    im = Image.open(io.BytesIO(data)).convert("RGB")
    im.putpixel((0, 0), (k % 256, (k // 256) % 256, 7))
    out = io.BytesIO()
    im.save(out, "PNG")
    return out.getvalue()


def ttft(client, model: str, data: bytes) -> tuple[float, int, int]:
    """(seconds to the first streamed event, prompt tokens, cached prompt tokens) of a one-token image chat."""
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe this picture."}]}]
    start = time.perf_counter()
    first, usage = None, None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        first = first if first is not None else time.perf_counter() - start
        usage = chunk.usage or usage
    return first, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def part_b(args, photos: dict[str, bytes], tmp: str) -> float:
    """TTFT through the gateway, warm (feature-cache + prefix hit) vs cold; returns the median warm/cold ratio."""
    import httpx
    import openai

    model = "qwen2-vl-2b-width-random"
    ckpt = write_qwen2_vl(Path(tmp) / model, vision={**QWEN2_VL_2B_VISION, "depth": args.depth},
                          text={**QWEN2_VL_2B_TEXT_FULL, "num_hidden_layers": args.text_layers},
                          mrope_section=(16, 24, 24), min_pixels=56 * 56, max_pixels=28 * 28 * 16384,
                          tokenizer=True, weight_std=0.02)
    procs = []
    try:
        rproc, url = start_redis(tmp)
        procs.append(rproc)
        vproc, vision = start_vision(ckpt, url, args.threads)
        procs.append(vproc)
        dport = free_port()
        dproc = subprocess.Popen([sys.executable, "-m", "services.decoder", "--model", str(ckpt), "--host", "127.0.0.1",
                                  "--port", str(dport), "--threads", str(args.threads), "--kv-cache-gb", "0.5",
                                  "--log-level", "WARNING", "--insecure-no-auth"], cwd=ROOT)
        procs.append(dproc)
        for address, proc in ((vision, vproc), (f"127.0.0.1:{dport}", dproc)):
            with grpc.insecure_channel(address) as channel:
                wait_serving(channel, proc)
        gport = free_port()
        gproc = subprocess.Popen([sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(gport),
                                  "--decoder", f"127.0.0.1:{dport}", "--vision", vision, "--log-level", "WARNING"],
                                 cwd=ROOT)
        procs.append(gproc)
        base = f"http://127.0.0.1:{gport}"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if gproc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the gateway never became ready")
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        ttft(client, model, variant(photos["chelsea.png"], 0))  # warm-up (allocators, thread pools)
        names = ("astronaut.png", "chelsea.png")
        cold: dict[str, list[float]] = {n: [] for n in names}
        warm: dict[str, list[float]] = {n: [] for n in names}
        k = 1
        for r in range(args.rounds):
            for name in names:
                data = variant(photos[name], k)
                k += 1
                seconds, prompt, cached = ttft(client, model, data)
                assert cached < prompt // 2, f"a cold request hit the prefix cache ({cached}/{prompt})"
                cold[name].append(seconds)
                for _ in range(2):
                    seconds, prompt, cached = ttft(client, model, data)
                    assert cached >= prompt - 16, f"a repeat missed the prefix cache ({cached}/{prompt})"
                    warm[name].append(seconds)
            print(f"(b) round {r + 1}/{args.rounds} done", flush=True)
    finally:
        stop_all(procs)
    return summarize(cold, warm, "cold TTFT", "warm TTFT",
                     f"vision (b) through the gateway, tower depth {args.depth}/32, text {args.text_layers}/28 "
                     f"layers at Qwen2-VL-2B width")


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=4, help="vision blocks (Qwen2-VL-2B has 32)")
    ap.add_argument("--text-layers", type=int, default=2, help="(b) text layers (Qwen2-VL-2B has 28)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads of each service; 0 = torch default")
    ap.add_argument("--part", choices=("a", "b", "both"), default="both")
    args = ap.parse_args()
    data_dir = Path(importlib.util.find_spec("skimage").origin).parent / "data"
    photos = {n: (data_dir / n).read_bytes() for n in PHOTOS}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("a", "both"):
            ratios.append(f"(a) hit/miss {part_a(args, photos, tmp):.3f}x (goal <= 0.1x)")
        if args.part in ("b", "both"):
            ratios.append(f"(b) warm/cold TTFT {part_b(args, photos, tmp):.3f}x")
    print("vision ratios: " + "; ".join(ratios))


if __name__ == "__main__":
    main()
