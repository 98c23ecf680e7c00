"""Prometheus metrics: each service exposes its registry over HTTP on --metrics-port."""
from __future__ import annotations

import logging

from prometheus_client import REGISTRY, start_http_server

log = logging.getLogger("tessera.metrics")

# Latency buckets (seconds) that resolve both millisecond pooling calls and long generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def serve(port: int, host: str = "0.0.0.0", registry=REGISTRY) -> None:
    """Start the /metrics HTTP endpoint for registry; port 0 disables it."""
    if port:
        start_http_server(port, addr=host, registry=registry)
        log.info("metrics on http://%s:%d/metrics", host, port)
