"""--metrics-port binds where the service binds (--host): a service kept on loopback exposes its /metrics on
loopback only, never on every interface."""
from __future__ import annotations

import asyncio
import socket
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from services.common.server import Server, ServerConfig
from tests.conftest import free_port


def connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_metrics_listen_on_the_service_host_only():
    registry = CollectorRegistry()
    Counter("tessera_bind_calls", "calls", registry=registry).inc()
    metrics_port = free_port()
    cfg = ServerConfig(host="127.0.0.1", port=0, metrics_port=metrics_port, insecure_no_auth=True, drain_seconds=0)

    async def scenario() -> None:
        server = Server(cfg, lambda _s: None, ["tessera.test.v1.Nothing"], registry=registry)
        await server.start()
        try:
            assert server.metrics is not None and server.metrics.server_address[0] == "127.0.0.1"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode())
            assert "tessera_bind_calls_total 1.0" in body
            # Linux routes all of 127/8 to the loopback device: a socket bound to 0.0.0.0 would answer on
            # 127.0.0.2 as well, one bound to 127.0.0.1 refuses it.
            assert not await asyncio.to_thread(connects, "127.0.0.2", metrics_port)
        finally:
            await server.stop(0)
            if server.metrics is not None:
                await asyncio.to_thread(server.metrics.shutdown)
                server.metrics.server_close()

    asyncio.run(scenario())


def test_no_metrics_port_starts_no_endpoint():
    cfg = ServerConfig(host="127.0.0.1", port=0, insecure_no_auth=True, drain_seconds=0)

    async def scenario() -> None:
        server = Server(cfg, lambda _s: None, ["tessera.test.v1.Nothing"], registry=CollectorRegistry())
        await server.start()
        await server.stop(0)
        assert server.metrics is None

    asyncio.run(scenario())
