"""Backpressure at the HTTP edge, one rule book: how many requests run at once, per key, and how long a response
may wait on a client that does not read.

- At most --max-concurrent-requests requests in flight, and at most --max-concurrent-per-key of them under one
  API key; past either, 429 + Retry-After at once. A request counts from the moment it is let in until its
  response has been sent in full, so a streaming generation holds its place until the stream ends. Probes,
  scrapes and the API description (edge.PUBLIC_PATHS) are never limited: a load balancer must still see /ready
  when the gateway is busy. Refusing at once, rather than queueing, keeps latency bounded and lets a client or a
  balancer send the work elsewhere; the backends' own bounded queues (RESOURCE_EXHAUSTED) give the same answer.
- A send that stays blocked for --send-timeout-s (the client's receive window and the server's write buffer are
  full: the client stopped reading) cuts the connection. The app then sees the client gone, as for any
  disconnect: the stream's Generation is closed, which cancels its decoder calls (their KV blocks and adapter
  leases return), and its places above are given back. Without it a client that never reads would hold its
  place for as long as the generation lasts, and 256 of them would lock every other client out.
- At most --max-tokens-per-minute-per-key tokens (prompt + completion, as usage reports them) per tenant: a
  token bucket per tenant (gateway/tenants.py; keys of one tenant share it, so rotating a key does not double
  the budget; with no API key every caller is one tenant), holding at most a minute's tokens and refilled
  continuously. A metered request (TokenRateLimit.METERED) is let in while its tenant's bucket is positive, and
  refused with 429 + Retry-After (the seconds until it is positive again) when it is not. What a request spent
  is debited when it ends, a stream's when the stream ends, also when its client leaves: the cost of a
  generation is unknown until then, so one request may overdraw the bucket and the next ones wait.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import Counter, Gauge

from services.common.errors import Overloaded

from .edge import PUBLIC_PATHS
from .errors import error_response

log = logging.getLogger("tessera.gateway.limits")

IN_FLIGHT = Gauge("tessera_gateway_requests_in_flight", "HTTP requests being answered (limited ones)")
TOKEN_RATE_REFUSALS = Counter("tessera_gateway_token_rate_refusals_total",
                              "requests refused because their tenant spent --max-tokens-per-minute-per-key")
SEND_TIMEOUTS = Counter("tessera_gateway_send_timeouts_total",
                        "responses cut because the client read nothing for --send-timeout-s")


def per_key_limit(configured: int | None, limit: int, keys: int) -> int:
    """The per-key limit in force (0: none). Unset: half the global limit when two or more API keys are
    configured, so one key cannot take every place; with one key (or none) that key is every caller and the
    global limit is already its limit."""
    if configured is not None:
        return configured
    return max(1, limit // 2) if keys > 1 and limit else 0


class ConcurrencyLimit:
    """ASGI middleware; limit 0 lets everything through, per_key 0 has no per-key bound. Install inside Edge, so
    a refusal still gets the request id, the access log line and the metrics, an unauthenticated request never
    takes a place, and the key a request came with is known (Edge puts its index in scope state `key_index`)."""

    def __init__(self, app, *, limit: int, per_key: int = 0):
        self.app = app
        self.limit = limit
        self.per_key = per_key
        self.in_flight = 0
        self.by_key: Tally[int] = Tally()   # key index -> its requests in flight

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (self.limit or self.per_key) or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope.get("state", {})
        key = state.get("key_index") if self.per_key else None
        if self.limit and self.in_flight >= self.limit:
            err = Overloaded(f"the gateway is at its limit of {self.limit} concurrent requests; retry later")
        elif key is not None and self.by_key[key] >= self.per_key:
            err = Overloaded(f"this API key is at its limit of {self.per_key} concurrent requests; retry later")
        else:
            err = None
        if err is not None:
            await error_response(err, state.get("request_id"), scope["path"])(scope, receive, send)
            return
        # One event loop serves every request, so this check-then-increment cannot race.
        self.in_flight += 1
        if key is not None:
            self.by_key[key] += 1
        IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if key is not None:
                self.by_key[key] -= 1
                if not self.by_key[key]:
                    del self.by_key[key]
            IN_FLIGHT.dec()


class Spent(Protocol):
    """A request's usage that is still counting (a generation's, gateway/generation.py Usage)."""

    def spent(self) -> int: ...


@dataclass
class Meter:
    """What one metered request spends, read when it ends: tokens already known plus live usages."""

    tokens: int = 0
    live: list[Spent] = field(default_factory=list)

    def total(self) -> int:
        return self.tokens + sum(u.spent() for u in self.live)


def bill(request, spent: int | Spent) -> None:
    """The one hook the routes call: add to the request's spend a count of tokens, or a usage read when the
    request ends. A no-op where no token rate is in force (no Meter in the request's state)."""
    meter: Meter | None = getattr(request.state, "meter", None)
    if meter is None:
        return
    if isinstance(spent, int):
        meter.tokens += spent
    else:
        meter.live.append(spent)


class TokenRateExceeded(Overloaded):
    code = "rate_limit_exceeded"   # OpenAI's code for a rate limit


class TokenBuckets:
    """A token bucket per tenant: per_minute tokens at most, refilled at per_minute / 60 a second. A level
    may go below zero (debits come after the fact)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.clock = clock
        self.levels: dict[str, tuple[float, float]] = {}   # tenant -> (level, when it was that)

    def level(self, tenant: str) -> float:
        now = self.clock()
        level, at = self.levels.get(tenant, (self.capacity, now))
        level = min(self.capacity, level + (now - at) * self.rate)
        if level >= self.capacity:
            self.levels.pop(tenant, None)   # a full bucket is the default: idle tenants take no memory
        else:
            self.levels[tenant] = (level, now)
        return level

    def wait_s(self, tenant: str) -> int:
        """Whole seconds until the tenant's bucket is positive; 0: it is now."""
        level = self.level(tenant)
        return 0 if level > 0 else math.floor(-level / self.rate) + 1

    def debit(self, tenant: str, tokens: int) -> None:
        level = self.level(tenant) - tokens
        if level < self.capacity:
            self.levels[tenant] = (level, self.clock())


class TokenRateLimit:
    """ASGI middleware, installed inside Edge like ConcurrencyLimit (it reads `key_index`). tenant_ids: the
    tenant of each key index (gateway/tenants.py Tenants.ids)."""

    # The routes whose usage counts: generation, embeddings and rerank. Token counting, the model list and
    # probes cost no generation and stay free.
    METERED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                         "/v1/embeddings", "/v1/rerank", "/v2/rerank", "/rerank"})

    def __init__(self, app, *, per_minute: int, tenant_ids: tuple[str, ...] = ()):
        self.app = app
        self.buckets = TokenBuckets(per_minute) if per_minute else None
        self.tenant_ids = tenant_ids

    async def __call__(self, scope, receive, send):
        if self.buckets is None or scope["type"] != "http" or scope["path"] not in self.METERED:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        key = state.get("key_index")
        tenant = self.tenant_ids[key] if key is not None and key < len(self.tenant_ids) else ""
        wait = self.buckets.wait_s(tenant)
        if wait:
            TOKEN_RATE_REFUSALS.inc()
            err = TokenRateExceeded(f"this API key's tenant has spent its {self.buckets.capacity:.0f} tokens"
                                    f" per minute; retry after {wait} s")
            await error_response(err, state.get("request_id"), scope["path"], retry_after=wait)(
                scope, receive, send)
            return
        meter = state["meter"] = Meter()
        try:
            await self.app(scope, receive, send)
        finally:
            # The app returns once the response is sent in full or the client has gone; a stream's
            # Generation is closed by then, so its usage holds all it will ever hold.
            self.buckets.debit(tenant, meter.total())


class SendTimeout:
    """ASGI middleware that must wrap the whole app, outside Starlette's own (app.py): it needs the server's
    `send`. Under uvicorn that send waits on the transport draining below its high-water mark (64 KiB buffered
    past the kernel's socket buffers) before it writes, and waits forever for a client that never reads.

    Past timeout_s the transport is aborted, which uvicorn reports to the app as a disconnect (its `receive`
    answers http.disconnect and later sends are dropped), so the response unwinds as for a client that left.
    Under a server whose send is not uvicorn's the blocked send raises OSError instead.

    A timer costs ~4 us a send, once per streamed token; uvicorn's send waits only while its flow control has
    paused writing, so the timer is armed only then."""

    def __init__(self, app, *, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.timeout_s:
            await self.app(scope, receive, send)
            return

        cycle = getattr(send, "__self__", None)   # uvicorn's RequestResponseCycle (h11 or httptools)
        flow = getattr(cycle, "flow", None)

        async def bounded_send(message):
            if flow is not None and not flow.write_paused:
                await send(message)
                return
            try:
                # A timer per send, not a task (asyncio.wait_for's): a stream sends once per token.
                async with asyncio.timeout(self.timeout_s):
                    await send(message)
            except TimeoutError:
                SEND_TIMEOUTS.inc()
                rid = scope.get("state", {}).get("request_id", "-")
                log.warning("client read nothing for %.0f s; connection cut (request_id=%s)", self.timeout_s, rid)
                transport = getattr(cycle, "transport", None)
                if transport is None:
                    raise OSError(f"client read nothing for {self.timeout_s} s") from None
                transport.abort()

        await self.app(scope, receive, bounded_send)
