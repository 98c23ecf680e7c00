"""Prometheus metrics: each service exposes its registry over HTTP on --metrics-port."""
from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, start_http_server

log = logging.getLogger("tessera.metrics")

# Latency buckets (seconds) that resolve both millisecond pooling calls and long generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def serve(port: int, host: str, registry=REGISTRY) -> WSGIServer | None:
    """Start the /metrics HTTP endpoint for registry on host:port (a daemon thread serves it); port 0 disables
    it. host has no default: a service binds its metrics where it binds gRPC (--host), so a service kept on
    loopback never exposes them on every interface. Returns the HTTP server, or None when disabled."""
    if not port:
        return None
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return httpd
