"""The HTTP edge, as one ASGI middleware: request id, API key, body-size limit, access log and metrics.

It runs before FastAPI reads the body, so an oversized body is refused (413)
before it is buffered past the limit, and a missing key (401) before any work.
"""
from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from prometheus_client import Counter, Histogram

from services.common.errors import TesseraError, TooLarge, Unauthenticated
from services.common.metrics import LATENCY_BUCKETS

from . import admin
from .admin import ADMIN_PATHS
from .errors import error_response

log = logging.getLogger("tessera.gateway.access")

# Module-level: the Prometheus registry is process-wide, and tests build several apps.
REQUESTS = Counter("tessera_gateway_requests_total", "HTTP requests answered", ["route", "status"])
LATENCY = Histogram("tessera_gateway_request_seconds", "HTTP request latency", ["route"], buckets=LATENCY_BUCKETS)

# Probes, scrapes and the API description stay reachable without a key.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                          "/redoc"})
# A caller's id is echoed only if it is short and plain; anything else is replaced.
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class Edge:
    """ASGI middleware around the FastAPI app; `routes` are the known paths (metric labels)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, routes: frozenset[str],
                 admin_key: str | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.admin_key = admin_key.encode() if admin_key else None
        self.max_body_bytes = max_body_bytes
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received_ns = time.monotonic_ns()  # the start of a traced request's timeline (x-tessera-trace)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        rid = given if _SANE_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {}).update(request_id=rid, received_ns=received_ns)
        path = scope["path"]
        route = path if path in self.routes else "other"
        started = time.perf_counter()
        status = [500]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                extra = [(b"x-request-id", rid.encode())]
                message = {**message, "headers": [*[h for h in message.get("headers", [])
                                                     if h[0].lower() != b"x-request-id"], *extra]}
            await send(message)

        try:
            self._authenticate(path, headers)
            receive = await self._bounded_body(headers, receive)
        except TesseraError as err:
            await error_response(err, rid, path)(scope, receive, send_with_id)
        else:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            REQUESTS.labels(route, str(status[0])).inc()
            LATENCY.labels(route).observe(elapsed)
            log.info("%s %s %d %.1fms request_id=%s", scope["method"], path, status[0], elapsed * 1000, rid)

    def _authenticate(self, path: str, headers: dict) -> None:
        if path in ADMIN_PATHS:
            admin.authorize(self.admin_key, headers)  # the admin key, not the API key (gateway/admin.py)
            return
        if self.api_key is None or path in PUBLIC_PATHS:
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            # Anthropic's clients send the key as x-api-key; the same key either way.
            token = headers.get("x-api-key", "")
        if not token.strip():
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        if not hmac.compare_digest(token.strip().encode(), self.api_key):
            raise Unauthenticated("invalid API key")

    async def _bounded_body(self, headers: dict, receive):
        """Read the whole body (at most max_body_bytes) and return a receive that replays it."""
        limit = self.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"request body of {declared} bytes is over the {limit}-byte limit")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                # The client left; let the app see the disconnect.
                return _replay([message], receive)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"request body is over the {limit}-byte limit")
            chunks.append(chunk)
            more = message.get("more_body", False)
        return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replay(messages: list, receive):
    """A receive that yields the buffered messages, then defers to the real one (disconnects)."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()
    return replay
