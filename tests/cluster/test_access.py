"""Inside the running compose cluster, as a process on the fleet's network would try it: a backend refuses
LoadAdapter, Generate and reflection without the backend token, Redis refuses a client without the password,
and every container runs as a non-root user on a read-only root with /tmp its one writable path.

Collected before tests/cluster/test_cluster.py (whose last test takes the cluster down); it only reads and
probes, so that file's tests start from the same healthy fleet.
"""
from __future__ import annotations

import pytest

from deploy import cluster as cluster_mod

try:
    cluster_mod.find_engine(install=not cluster_mod.settings().no_install)
except cluster_mod.EngineUnavailable as exc:
    pytest.skip(f"cluster test NOT RUN: {exc}", allow_module_level=True)

SERVICES = ("redis", "vision", "decoder", "decoder-vl", "pooling", "gateway")

# Run inside the gateway's container: raw calls on the decoder with no token, each printed as "NAME CODE"
# (ANSWERED when it got a reply). LoadAdapter is what an attacker on the network would send first (it would
# put other weights behind an adapter's name); Generate would serve without the gateway's key and limits
# (its empty request would be INVALID_ARGUMENT were it let in); reflection would list every method (it is
# off in the fleet, and without the token it is refused as if it were on: services/common/auth.py).
# The script leaves by os._exit once its lines are out: a run on a loaded 2-CPU machine printed all three and
# then did not exit within a minute (a grpc thread of the refused streaming call holding the interpreter open).
UNAUTHENTICATED_CALLS = """
import os
import grpc
channel = grpc.insecure_channel("decoder:50052")
calls = {
    "LoadAdapter": lambda: channel.unary_unary("/tessera.decoder.v1.DecoderService/LoadAdapter")(b"", timeout=20),
    "Generate": lambda: list(channel.unary_stream("/tessera.decoder.v1.DecoderService/Generate")(b"", timeout=20)),
    "reflection": lambda: list(channel.stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(iter([b""]), timeout=20)),
}
for name, call in calls.items():
    try:
        call()
        print(name, "ANSWERED", flush=True)
    except grpc.RpcError as exc:
        print(name, exc.code().name, flush=True)
os._exit(0)
"""
REFUSED = {name: "UNAUTHENTICATED" for name in ("LoadAdapter", "Generate", "reflection")}

# Run inside the vision container (it has the redis client): a client that sends no password.
NO_PASSWORD = """
import redis
try:
    redis.Redis(host="redis", port=6380, socket_timeout=10).dbsize()
    print("ANSWERED")
except redis.exceptions.RedisError as exc:
    print(type(exc).__name__, exc)
"""


def exec_in(cluster, service: str, *argv: str):
    cid = cluster.container(service, running=True)
    assert cid is not None, f"{service} is not running"
    return cluster("exec", cid, *argv, check=False, timeout=60)


def codes(stdout: str) -> dict[str, str]:
    """UNAUTHENTICATED_CALLS' "NAME CODE" lines -> {name: code}."""
    return dict(line.split(None, 1) for line in stdout.splitlines() if line.strip())


def test_a_backend_refuses_calls_without_the_token(cluster):
    done = exec_in(cluster, "gateway", "python", "-c", UNAUTHENTICATED_CALLS)
    assert codes(done.stdout) == REFUSED, done.stdout + done.stderr


def test_redis_refuses_a_client_without_the_password(cluster):
    done = exec_in(cluster, "vision", "python", "-c", NO_PASSWORD)
    assert done.stdout.startswith("AuthenticationError"), done.stdout + done.stderr


@pytest.mark.parametrize("service", SERVICES)
def test_the_container_runs_non_root_on_a_read_only_root(cluster, service):
    uid = exec_in(cluster, service, "id", "-u")
    assert uid.returncode == 0 and uid.stdout.strip() not in ("", "0"), uid.stdout + uid.stderr
    assert exec_in(cluster, service, "touch", "/probe").returncode != 0, "the root filesystem is writable"
    scratch = exec_in(cluster, service, "sh", "-c", "touch /tmp/probe && rm /tmp/probe")
    assert scratch.returncode == 0, scratch.stdout + scratch.stderr
    # cap_drop ALL empties the bounding set (a non-root user's effective set is empty anyway), and
    # no-new-privileges is set on every process.
    lines = exec_in(cluster, service, "cat", "/proc/self/status").stdout.splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    assert status["CapBnd"].strip().strip("0") == "" and status["NoNewPrivs"].strip() == "1", status
