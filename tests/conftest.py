"""Fixtures every test package shares: free ports, a private redis-server, the --run-slow switch."""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

# Nothing may reach a model hub; tests build tiny checkpoints locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Decoders these tests start as processes take greedy tokens of fp32 models through the argmax screen
# (services/decoder/model/screen.py), whatever the load-time timing would pick on the tiny models, so that
# each greedy parity test against transformers, peft and vLLM checks it: the option --fast-paths, read
# from the decoder's environment. In-process runners and servers of the parity tests pin it where they
# build them (fast_paths="screen=on"); tests/decoder/runner/test_runner.py runs both pins and
# tests/decoder/model/test_screen.py the timing.
os.environ.setdefault("TESSERA_DECODER_FAST_PATHS", "screen=on")
# Without a GPU, Triton kernels run under the interpreter; this must be set before
# any kernel module is imported (decoration reads it). CI machines have no GPU.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow (make test-slow)")
    parser.addoption("--cluster", action="store_true",
                     help="collect tests/cluster: the compose cluster in real containers (make cluster-test)")


CLUSTER_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster")


def pytest_ignore_collect(collection_path, config):
    """tests/cluster drives real containers: `make cluster-test` only. Without --cluster it is not collected
    at all (neither run nor counted as skipped), so `make test` stays what it was."""
    if str(collection_path) == CLUSTER_TESTS and not config.getoption("--cluster"):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    slow = pytest.mark.skip(reason="slow fault/load test: run with make test-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(slow)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()
_given: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, below the kernel's ephemeral range and not handed out
    before in this process. A port from bind(0) lies in that range, where any outgoing connection may
    take it before the server under test binds it (seen in CI: the gateway's EADDRINUSE)."""
    for _ in range(1000):
        port = random.randrange(20000, max(20001, _EPHEMERAL_LOW))
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError("no free TCP port below the ephemeral range on 127.0.0.1")


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server on a free port; yields its URL, stops it after the test."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (.ci/run installs it with apt)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)
