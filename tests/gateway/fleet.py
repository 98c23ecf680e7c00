"""Helpers that run real servers for the gateway tests: uvicorn in a thread, gRPC servers on their own loop,
and service subprocesses waited on through grpc.health.v1."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import openai
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import HTTP_PARSER, create_app
from gateway.config import GatewayConfig
from tests.loops import LoopThread  # noqa: F401 - re-exported for the gateway tests

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def clients(url: str, key: str | None, timeout: float = 120):
    """{"url", "client" (openai), "http" (httpx)} for a gateway at url, both sending key as the API key
    (None: the httpx client sends none). What every fleet yields, and what the `client` and `http`
    fixtures (tests/gateway/conftest.py) hand to the tests."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=timeout) as http:
        yield {"url": url, "http": http,
               "client": openai.OpenAI(base_url=url + "/v1", api_key=key or "unused", max_retries=0, timeout=timeout)}


class GatewayThread:
    """create_app(cfg) under uvicorn on cfg.port in a background thread. send_buffer: the SO_SNDBUF of every
    connection (set on the listening socket, which accepted ones inherit); unset: the kernel's, which grows to
    megabytes, so a test of a client that never reads would first have to fill that much."""

    def __init__(self, cfg: GatewayConfig, send_buffer: int | None = None):
        self.cfg = cfg
        self.url = f"http://127.0.0.1:{cfg.port}"
        config = uvicorn.Config(create_app(cfg), host="127.0.0.1", port=cfg.port, log_level="warning",
                                access_log=False, lifespan="on", http=HTTP_PARSER)
        self.server = uvicorn.Server(config)
        sockets = None
        if send_buffer is not None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
            listener.bind(("127.0.0.1", cfg.port))
            sockets = [listener]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": sockets}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(20)


def wait_serving(address: str, service: str, proc: subprocess.Popen | None = None, timeout: float = 90) -> None:
    """Block until address reports SERVING for service (grpc.health.v1), or fail with the reason."""
    deadline = time.time() + timeout
    last = "no answer"
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.time() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{service} exited with {proc.returncode} before serving")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(0.1)
    raise RuntimeError(f"{service} at {address} not SERVING after {timeout}s (last: {last})")


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 60) -> httpx.Response:
    """Block until GET url answers 200."""
    deadline = time.time() + timeout
    last = "no answer"
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            reply = httpx.get(url, timeout=2)
            if reply.status_code == 200:
                return reply
            last = f"{reply.status_code} {reply.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 after {timeout}s (last: {last})")


def python_module(module: str, args: list[str], log_path: Path) -> subprocess.Popen:
    """`python -m module args` from the repository root, output to log_path."""
    log = open(log_path, "wb")  # noqa: SIM115 - the child owns it until it exits
    # The tests' services listen on loopback for the test alone and their clients send no backend token;
    # tests/common/test_auth.py checks the token on real servers and the refusal to start without either.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TESSERA_INSECURE_NO_AUTH": "1"}
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it does not drain in time."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def redis_process(port: int, folder: Path) -> subprocess.Popen:
    """A private redis-server on port (no persistence), once it accepts connections."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (.ci/run installs it with apt)")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    stop(proc)
    raise RuntimeError("redis-server did not start")
