"""Which decoder replica gets a generation call, in which order the others are tried, and adapter affinity.

Several `--decoder` replicas may serve one base model. The catalog resolves a request's `model` to what it
names; `Router.route` turns that into a `Route`, the one place a replica is chosen. A call's candidates are
every replica that serves the model's base model (an adapter's parent), ordered by:

1. replicas that answered UNAVAILABLE in the last FAILED_AVOID_S seconds go last (a dead or draining
   replica should not be everyone's first try while the others are fine);
2. for an adapter request (GenerateRequest.adapter): replicas where the adapter is resident in a device
   slot first, then those that only hold it registered on the host, then the rest (the request may
   still fail there with NOT_FOUND, which is an answer, not a retry);
3. fewest calls in flight (Backend.in_flight: a stream counts until it ends);
4. flag order, so ties are stable.

Generation tries them in that order while a replica answers UNAVAILABLE before its first message
(each replica at most once); after the first message nothing is retried (gateway/generation.py).
A unary call (tokenize, detokenize) goes to the first candidate.

Residency comes from each decoder's ListAdapters (slot >= 0 is resident), cached for RESIDENCY_MAX_AGE_S
and fetched only when an adapter request needs it; the admin adapter endpoints call
`Router.residency.invalidate()` after a load or unload so the next request sees the change.
"""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request

from services.common.errors import TesseraError
from services.common.pb import decoder_pb2

from .backends import GENERATION, Backend, Catalog, Model

log = logging.getLogger("tessera.gateway.routing")

FAILED_AVOID_S = 5.0
RESIDENCY_MAX_AGE_S = 2.0
RESIDENT, REGISTERED, ABSENT = 0, 1, 2


class Residency:
    """backend label -> {adapter name: slot}, from the decoders' ListAdapters."""

    def __init__(self, max_age_s: float = RESIDENCY_MAX_AGE_S):
        self.max_age_s = max_age_s
        self.slots: dict[str, dict[str, int]] = {}
        self.refreshed_at = float("-inf")
        self._lock = asyncio.Lock()

    def invalidate(self) -> None:
        """Forget the cached answer (after an adapter load or unload)."""
        self.refreshed_at = float("-inf")

    async def refresh(self, backends: list[Backend]) -> None:
        """Ask every replica again unless the cached answer is fresh; a replica that fails to answer counts as
        holding nothing (its calls still go through the normal order and retry rule)."""
        async with self._lock:
            if time.monotonic() - self.refreshed_at < self.max_age_s:
                return
            replies = await asyncio.gather(*(b.call(b.decoder.ListAdapters, decoder_pb2.ListAdaptersRequest(),
                                                    "adapter-residency") for b in backends),
                                           return_exceptions=True)
            slots = {}
            for backend, reply in zip(backends, replies, strict=True):
                if isinstance(reply, TesseraError):
                    log.warning("ListAdapters failed on %s: %s", backend.label, reply.message)
                    continue
                if isinstance(reply, BaseException):
                    raise reply
                slots[backend.label] = {a.name: a.slot for a in reply.adapters}
            self.slots = slots
            self.refreshed_at = time.monotonic()

    def tier(self, backend: Backend, adapter: str) -> int:
        slot = self.slots.get(backend.label, {}).get(adapter)
        if slot is None:
            return ABSENT
        return RESIDENT if slot >= 0 else REGISTERED


class Router:
    """The gateway's replica choice; one per app (app.state.router)."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.residency = Residency()
        self.failed_at: dict[str, float] = {}  # backend label -> when it last answered UNAVAILABLE

    def route(self, model: Model) -> Route:
        """The routing of calls for model (as the catalog resolved it): every decoder replica serving its base
        model, or, for a name the catalog has no base entry for, the replicas serving the name itself."""
        base = model.parent or model.name
        replicas = [m.backend for m in self.catalog.by_name.get(base, ()) if m.kind == GENERATION]
        if not replicas:
            replicas = [m.backend for m in self.catalog.by_name.get(model.name, ()) if m.kind == GENERATION]
        return Route(self, model, replicas or [model.backend])

    async def order(self, replicas: list[Backend], adapter: str) -> list[Backend]:
        """replicas, best first (see the module docstring); adapter "" for a base-model call."""
        tiers = {}
        if adapter and len(replicas) > 1:
            await self.residency.refresh(replicas)
            tiers = {b.label: self.residency.tier(b, adapter) for b in replicas}
        now = time.monotonic()
        position = {b.label: i for i, b in enumerate(replicas)}
        return sorted(replicas, key=lambda b: (now - self.failed_at.get(b.label, float("-inf")) < FAILED_AVOID_S,
                                               tiers.get(b.label, ABSENT), b.in_flight, position[b.label]))

    def failed(self, backend: Backend) -> None:
        """backend answered UNAVAILABLE: try it last for a while."""
        self.failed_at[backend.label] = time.monotonic()

    def answered(self, backend: Backend) -> None:
        """backend answered: it is back in normal rotation."""
        self.failed_at.pop(backend.label, None)


class Route:
    """One request's routing, the only place a replica is chosen: the model it calls and the replicas that
    can serve it. Generation (gateway/generation.py) and the unary decoder routes work with this alone."""

    def __init__(self, router: Router, model: Model, replicas: list[Backend]):
        self.router = router
        self.model = model
        self.replicas = replicas

    async def candidates(self) -> list[Backend]:
        """The replicas to try, best first, as of now (loads and failures change between calls)."""
        return await self.router.order(self.replicas, self.model.target()["adapter"])

    async def best(self) -> Backend:
        """The one replica for a unary call (no retry: its answer, or its error, is the answer)."""
        return (await self.candidates())[0]

    def failed(self, backend: Backend) -> None:
        self.router.failed(backend)

    def answered(self, backend: Backend) -> None:
        self.router.answered(backend)


def router(request: Request) -> Router:
    """The app's Router, made on first use (it only needs the catalog, which the lifespan builds)."""
    state = request.app.state
    found = getattr(state, "router", None)
    if found is None:
        found = state.router = Router(state.catalog)
    return found


def route(request: Request, model: Model) -> Route:
    """The routing of a generation or token request for model (as resolved by the catalog)."""
    return router(request).route(model)
