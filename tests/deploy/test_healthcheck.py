"""services/common/healthcheck.py against a real in-process gRPC health server and a real HTTP server:
the exit code is what docker compose reads, so each status must map to the right one."""
from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import healthcheck
from tests.conftest import free_port
from tests.deploy.topology import ROOT

NAME = "tessera.pooling.v1.PoolingService"


@pytest.fixture(scope="module")
def health_server():
    """A real grpc server with grpc.health.v1: yields (port, servicer) so a test can flip statuses."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(0)


def set_status(servicer, status) -> None:
    for name in ("", NAME):
        servicer.set(name, status)


def test_serving_is_healthy_and_not_serving_is_not(health_server, capsys):
    port, servicer = health_server
    set_status(servicer, health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([f"127.0.0.1:{port}", NAME]) == healthcheck.OK
    assert healthcheck.main([f"127.0.0.1:{port}"]) == healthcheck.OK  # "" = the whole server
    # While loading or draining our servers say NOT_SERVING: the container must read as unhealthy.
    set_status(servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([f"127.0.0.1:{port}", NAME]) == healthcheck.NOT_READY
    assert "NOT_SERVING" in capsys.readouterr().out


def test_unknown_service_and_dead_port_are_unhealthy(health_server, capsys):
    port, servicer = health_server
    set_status(servicer, health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([f"127.0.0.1:{port}", "tessera.nope.v1.Nope"]) == healthcheck.NOT_READY
    assert "NOT_FOUND" in capsys.readouterr().out
    assert healthcheck.main([f"127.0.0.1:{free_port()}", NAME, "--timeout", "0.5"]) == healthcheck.NOT_READY


def test_bad_usage_exits_2(capsys):
    assert healthcheck.main(["no-port-here"]) == healthcheck.USAGE
    assert healthcheck.main(["http://127.0.0.1:1/ready", NAME]) == healthcheck.USAGE
    assert healthcheck.main([]) == healthcheck.USAGE


class _Ready(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args):  # keep pytest output clean
        pass


def test_http_2xx_is_healthy_and_503_is_not():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/ready"
    try:
        _Ready.status = 200
        assert healthcheck.main([url]) == healthcheck.OK
        _Ready.status = 503  # the gateway's /ready while a backend is down
        assert healthcheck.main([url]) == healthcheck.NOT_READY
    finally:
        server.shutdown()
        server.server_close()
    assert healthcheck.main([url, "--timeout", "0.5"]) == healthcheck.NOT_READY  # nobody listening


def test_module_entry_point_is_what_compose_runs(health_server):
    """compose runs `python -m services.common.healthcheck ...`: the exit code must come through."""
    port, servicer = health_server
    set_status(servicer, health_pb2.HealthCheckResponse.SERVING)
    argv = [sys.executable, "-m", "services.common.healthcheck", f"127.0.0.1:{port}", NAME]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "SERVING" in done.stdout
