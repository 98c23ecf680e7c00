"""The feature cache behind a Redis password (requirepass): a Redis that requires one answers nothing without
it; the vision service with --redis-password-file caches and hits; a wrong or missing password stops the start
with one logged line (status 1), not a traceback or a service that silently never caches."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis

from services.common.pb import vision_pb2, vision_pb2_grpc
from services.vision.config import VisionConfig
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "a6f0c1d2e3b4a5968778695a4b3c2d1e"


@pytest.fixture
def locked_redis(tmp_path):
    """A private redis-server that requires PASSWORD: yields its URL."""
    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                             "--requirepass", PASSWORD], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def secret(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def test_the_cache_works_with_the_password(locked_redis, vision_server, qwen_ckpt, photos, tmp_path):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(locked_redis).dbsize()
    cfg = VisionConfig(model=str(qwen_ckpt), redis_url=locked_redis,
                       redis_password_file=secret(tmp_path, "redis.password", PASSWORD))
    address, servicer, _ = vision_server(cfg)
    image = vision_pb2.ImageData(data=photos["chelsea.png"])
    with grpc.insecure_channel(address) as channel:
        stub = vision_pb2_grpc.VisionServiceStub(channel)
        first = stub.Encode(vision_pb2.EncodeRequest(images=[image]), timeout=60)
        second = stub.Encode(vision_pb2.EncodeRequest(images=[image]), timeout=60)
    assert [first.images[0].cached, second.images[0].cached] == [False, True]
    assert servicer.cache.stats.errors == 0
    assert redis.Redis.from_url(locked_redis, password=PASSWORD).dbsize() > 0


@pytest.mark.parametrize("password", ["wrong-password", None])
def test_a_refused_password_stops_the_start_in_one_line(locked_redis, password, tmp_path):
    argv = [sys.executable, "-m", "services.vision", "--model", str(ROOT / "models" / "qwen2-vl-random"),
            "--host", "127.0.0.1", "--port", "0", "--insecure-no-auth", "--redis-url", locked_redis]
    if password is not None:
        argv += ["--redis-password-file", secret(tmp_path, "redis.password", password)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "refused our credentials" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and PASSWORD not in done.stderr, done.stderr[-2000:]


def test_a_password_file_needs_a_url_and_content(tmp_path):
    with pytest.raises(ValueError, match="redis_password_file needs redis_url"):
        VisionConfig(model="m", redis_password_file=secret(tmp_path, "p", PASSWORD))
    with pytest.raises(ValueError, match="is empty"):
        VisionConfig(model="m", redis_url="redis://h:1/0", redis_password_file=secret(tmp_path, "p", ""))
