"""Backpressure at the HTTP edge: at most --max-concurrent-requests requests in flight, 429 + Retry-After past it.

A request counts from the moment it is let in until its response has been sent in full, so a
streaming generation holds its place until the stream ends. Probes, scrapes and the API description
(edge.PUBLIC_PATHS) are never limited: a load balancer must still see /ready when the gateway is busy.
Refusing at once, rather than queueing, keeps latency bounded and lets a client or a balancer send
the work elsewhere; the backends' own bounded queues (RESOURCE_EXHAUSTED) give the same answer.
"""
from __future__ import annotations

from prometheus_client import Gauge

from services.common.errors import Overloaded

from .edge import PUBLIC_PATHS
from .errors import error_response

IN_FLIGHT = Gauge("tessera_gateway_requests_in_flight", "HTTP requests being answered (limited ones)")


class ConcurrencyLimit:
    """ASGI middleware; limit 0 lets everything through. Install inside Edge, so a refusal still gets the
    request id, the access log line and the metrics, and an unauthenticated request never takes a place."""

    def __init__(self, app, *, limit: int):
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.limit or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            rid = scope.get("state", {}).get("request_id")
            err = Overloaded(f"the gateway is at its limit of {self.limit} concurrent requests; retry later")
            await error_response(err, rid)(scope, receive, send)
            return
        # One event loop serves every request, so this check-then-increment cannot race.
        self.in_flight += 1
        IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            IN_FLIGHT.dec()
