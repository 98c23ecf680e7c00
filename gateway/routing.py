"""Which decoder replica gets a generation call, in which order the others are tried, and adapter affinity.

Several `--decoder` replicas may serve one base model. The catalog resolves a request's `model` to what it
names; `Router.route` turns that into a `Route`, the one place a replica is chosen. A call's candidates are
every replica that serves the model's base model (an adapter's parent), ordered by:

1. replicas that answered UNAVAILABLE in the last FAILED_AVOID_S seconds go last (a dead or draining
   replica should not be everyone's first try while the others are fine);
2. for an adapter request (GenerateRequest.adapter): replicas where the adapter is resident (its weights
   placed for compute) first, then those that only hold it registered on the host, then the rest (the
   request may still fail there with NOT_FOUND, or load it by name from its adapter root);
3. the replica that last answered a call with the same prompt start (`prefix_key`: adapter, cache salt and
   the first PREFIX_CHARS characters of the prompt), whose prefix cache likely holds its KV, unless it has
   more than AFFINITY_SLACK calls in flight beyond the least loaded replica (then load wins);
4. fewest calls in flight (Backend.in_flight: a stream counts until it ends);
5. flag order, so ties are stable.

Generation tries them in that order while a replica answers UNAVAILABLE before its first message
(each replica at most once); after the first message nothing is retried (gateway/generation.py).
A unary call (tokenize, detokenize) goes to the first candidate.

Residency comes from each decoder's ListAdapters (slot >= 0 is resident), cached for RESIDENCY_MAX_AGE_S
and fetched only when an adapter request needs it; the admin adapter endpoints call
`Router.residency.invalidate()` after a load or unload so the next request sees the change.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict

from fastapi import Request

from services.common.errors import TesseraError
from services.common.pb import decoder_pb2

from .backends import GENERATION, Backend, Catalog, Model

log = logging.getLogger("tessera.gateway.routing")

FAILED_AVOID_S = 5.0
RESIDENCY_MAX_AGE_S = 2.0
RESIDENT, REGISTERED, ABSENT = 0, 1, 2
# Prompt characters that key prefix affinity: a shared system prompt or conversation start this long is
# several KV blocks (about 4 characters a token) that the replica which served it can hit.
PREFIX_CHARS = 256
AFFINITY_ENTRIES = 16384     # remembered prompt starts (least recently used forgotten first)
AFFINITY_SLACK = 4           # calls in flight an affine replica may carry beyond the least loaded one


def prefix_key(request: decoder_pb2.GenerateRequest) -> bytes | None:
    """A digest of what decides which cached KV blocks a call can reuse: its adapter, cache salt and the
    first PREFIX_CHARS characters of its prompt (token ids for a token prompt); None when the prompt is
    shorter than that (no prefix worth following a replica for) or carries images (whose rows are in the KV
    but not in these characters)."""
    which = request.WhichOneof("prompt")
    if request.images:
        return None
    if which == "text":
        head = request.text
    elif which == "token_ids":
        head = ",".join(map(str, request.token_ids.ids[:PREFIX_CHARS // 4]))
        if len(request.token_ids.ids) < PREFIX_CHARS // 4:
            return None
    elif which == "chat":
        parts = []
        for m in request.chat.messages:
            parts.append(f"\x00{m.role}\x00")
            parts.extend(c.text for c in m.content)
            if sum(map(len, parts)) >= PREFIX_CHARS:
                break
        head = "".join(parts)
    else:
        return None
    if len(head) < PREFIX_CHARS:
        return None
    h = hashlib.blake2b(digest_size=16)
    for field in (request.adapter, request.cache_salt, which, head[:PREFIX_CHARS]):
        h.update(field.encode())
        h.update(b"\x00")
    return h.digest()


class Affinity:
    """prompt-start key -> label of the replica that last answered it, bounded (least recently used out)."""

    def __init__(self, max_entries: int = AFFINITY_ENTRIES):
        self.max_entries = max_entries
        self.labels: OrderedDict[bytes, str] = OrderedDict()

    def get(self, key: bytes | None) -> str | None:
        if key is None:
            return None
        label = self.labels.get(key)
        if label is not None:
            self.labels.move_to_end(key)
        return label

    def remember(self, key: bytes | None, label: str) -> None:
        if key is None:
            return
        self.labels[key] = label
        self.labels.move_to_end(key)
        while len(self.labels) > self.max_entries:
            self.labels.popitem(last=False)


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
        self.affinity = Affinity()
        self.failed_at: dict[str, float] = {}  # backend label -> when it last answered UNAVAILABLE

    def route(self, model: Model) -> Route:
        """The routing of calls for model (as the catalog resolved it): every decoder replica serving its base
        model, or, for a name the catalog has no base entry for, the replicas serving the name itself."""
        base = model.parent or model.name
        replicas = [m.backend for m in self.catalog.by_name.get(base, ()) if m.kind == GENERATION]
        if not replicas:
            replicas = [m.backend for m in self.catalog.by_name.get(model.name, ()) if m.kind == GENERATION]
        return Route(self, model, replicas or [model.backend])

    async def order(self, replicas: list[Backend], adapter: str, key: bytes | None = None) -> list[Backend]:
        """replicas, best first (see the module docstring); adapter "" for a base-model call, key: the call's
        prefix_key."""
        tiers = {}
        if adapter and len(replicas) > 1:
            await self.residency.refresh(replicas)
            tiers = {b.label: self.residency.tier(b, adapter) for b in replicas}
        affine = self.affinity.get(key) if len(replicas) > 1 else None
        least = min(b.in_flight for b in replicas)
        now = time.monotonic()
        position = {b.label: i for i, b in enumerate(replicas)}
        return sorted(replicas, key=lambda b: (now - self.failed_at.get(b.label, float("-inf")) < FAILED_AVOID_S,
                                               tiers.get(b.label, ABSENT),
                                               not (b.label == affine and b.in_flight <= least + AFFINITY_SLACK),
                                               b.in_flight, position[b.label]))

    def failed(self, backend: Backend) -> None:
        """backend answered UNAVAILABLE: try it last for a while."""
        self.failed_at[backend.label] = time.monotonic()

    def answered(self, backend: Backend, key: bytes | None = None) -> None:
        """backend answered (a call with prefix_key `key`): it is back in normal rotation, and holds that prefix."""
        self.failed_at.pop(backend.label, None)
        self.affinity.remember(key, backend.label)


class Route:
    """One request's routing, the only place a replica is chosen: the model it calls and the replicas that
    can serve it. Generation (gateway/generation.py) and the unary decoder routes work with this alone."""

    def __init__(self, router: Router, model: Model, replicas: list[Backend]):
        self.router = router
        self.model = model
        self.replicas = replicas

    async def candidates(self, key: bytes | None = None) -> list[Backend]:
        """The replicas to try, best first, as of now (loads and failures change between calls); key: the
        call's prefix_key, if it is a generation."""
        return await self.router.order(self.replicas, self.model.target()["adapter"], key)

    async def best(self) -> Backend:
        """The one replica for a unary call (no retry: its answer, or its error, is the answer)."""
        return (await self.candidates())[0]

    def failed(self, backend: Backend) -> None:
        self.router.failed(backend)

    def answered(self, backend: Backend, key: bytes | None = None) -> None:
        self.router.answered(backend, key)


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
