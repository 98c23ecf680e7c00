"""The HTTP edge, as one ASGI middleware: request id, API key, body-size limit, access log and metrics.

It runs before FastAPI reads the body, so an oversized body is refused (413)
before it is buffered past the limit, and a missing key (401) before any work. Two bounds keep parsing cheap:
routes that never carry images take at most --max-text-body-bytes (a 12 MB embedding input is refused before
anything reads it), and a body with more than --max-messages `"role"` keys (messages or input items) is refused
by one scan of its bytes, before JSON parsing and validation, which take ~30 us per message.
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
# Routes whose bodies may carry images (base64 data URIs): these alone take up to --max-body-bytes.
IMAGE_PATHS = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/messages"})
# A key every message and input item has. In a JSON string a quote is escaped (\"), so text that mentions
# "role" is not counted; the exact count is checked again once parsed.
_ROLE_KEY = b'"role"'
# A caller's id is echoed only if it is short and plain; anything else is replaced.
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class Edge:
    """ASGI middleware around the FastAPI app; `routes` are the known paths (metric labels)."""

    def __init__(self, app, *, api_keys: tuple[str, ...], max_body_bytes: int, routes: frozenset[str],
                 admin_key: str | None = None, max_text_body_bytes: int | None = None, max_messages: int = 0):
        """api_keys: the accepted API keys; empty: no authentication."""
        self.app = app
        self.api_keys = tuple(key.encode() for key in api_keys)
        self.admin_key = admin_key.encode() if admin_key else None
        self.max_body_bytes = max_body_bytes
        self.max_text_body_bytes = min(max_text_body_bytes or max_body_bytes, max_body_bytes)
        self.max_messages = max_messages
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
            key_index = self._authenticate(path, headers)
            if key_index is not None:
                # Which key, for the per-key limit (gateway/limits.py); the key itself stays out of the scope.
                scope["state"]["key_index"] = key_index
            receive = await self._bounded_body(path, headers, receive)
        except TesseraError as err:
            await error_response(err, rid, path)(scope, receive, send_with_id)
        else:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            REQUESTS.labels(route, str(status[0])).inc()
            LATENCY.labels(route).observe(elapsed)
            log.info("%s %s %d %.1fms request_id=%s", scope["method"], path, status[0], elapsed * 1000, rid)

    def _authenticate(self, path: str, headers: dict) -> int | None:
        """The index of the API key the request came with; None where no API key is needed."""
        if path in ADMIN_PATHS:
            admin.authorize(self.admin_key, headers)  # the admin key, not the API key (gateway/admin.py)
            return None
        if not self.api_keys or path in PUBLIC_PATHS:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            # Anthropic's clients send the key as x-api-key; the same key either way.
            token = headers.get("x-api-key", "")
        if not token.strip():
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        given = token.strip().encode()
        # Every key is compared, so the time taken does not tell which one matched, if any.
        matches = [hmac.compare_digest(given, key) for key in self.api_keys]
        if not any(matches):
            raise Unauthenticated("invalid API key")
        return matches.index(True)

    async def _bounded_body(self, path: str, headers: dict, receive):
        """Read the whole body (at most the path's byte limit, at most max_messages messages) and return a
        receive that replays it."""
        if path in IMAGE_PATHS:
            limit, key = self.max_body_bytes, "max_body_bytes"
        else:
            limit, key = self.max_text_body_bytes, "max_text_body_bytes"
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"request body of {declared} bytes is over the {limit}-byte limit of {path} ({key})")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                # The client left; let the app see the disconnect.
                return _replay([message], receive)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"request body is over the {limit}-byte limit of {path} ({key})")
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if self.max_messages and body.count(_ROLE_KEY) > self.max_messages:
            raise TooLarge(f"request has more than {self.max_messages} messages or input items (max_messages)")
        return _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _replay(messages: list, receive):
    """A receive that yields the buffered messages, then defers to the real one (disconnects)."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()
    return replay
