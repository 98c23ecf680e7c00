"""The host-side adapter registry: names -> weights, and which content sits under which handle.

More adapters can be registered (--max-cpu-loras, weights on the host) than the adapter store
holds at once (the CUDA bank's --max-loras slots, the CPU pool's --lora-memory-gb bytes). Placed
content is keyed by digest, so two names with equal weights share one handle (and, through the
digest in block hashes, their prefix KV).

A request leases its adapter's handle at admission (`acquire`) and releases it when it
finishes, aborts or fails (`release`); a preempted request keeps it. Content with live
leases is never freed or rewritten. When a request's adapter is not placed, `acquire` asks the
store to place it, evicting the least recently used idle adapters one by one until that
succeeds; it answers None only when nothing idle is left to evict: the request keeps waiting
in the queue until a lease ends.

Not thread-safe: the service runs every call on the engine thread (AsyncEngine.call),
so store writes happen between forwards and never under a running step.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from services.common.errors import AdapterInUse, AdapterNotFound, InvalidArgument, Overloaded
from services.decoder.lora.store import AdapterStore
from services.decoder.lora.weights import LoraWeights

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass
class AdapterEntry:
    """A registered adapter. refs: live leases taken under this name."""

    name: str
    weights: LoraWeights
    refs: int = 0

    @property
    def digest(self) -> str:
        return self.weights.digest


@dataclass(frozen=True)
class AdapterStatus:
    """What ListAdapters reports for one name. slot: its store handle, -1 when not resident."""

    name: str
    digest: str
    rank: int
    targets: tuple[str, ...]
    slot: int
    refs: int


@dataclass
class Resident:
    """Content placed in the store under one handle. refs: live leases; used: last lease tick (LRU)."""

    digest: str
    refs: int = 0
    used: int = 0


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(f"adapter name {name!r} is invalid: 1-128 characters, letters, digits and ._:/@+- "
                              f"starting with a letter or digit", param="lora_name")


class AdapterRegistry:
    """bank: the adapter store (the CUDA AdapterBank or the CPU AdapterPool)."""

    def __init__(self, bank: AdapterStore, max_cpu_loras: int):
        if bank.num_slots is not None and max_cpu_loras < bank.num_slots:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least the slot count ({bank.num_slots})")
        self.bank = bank
        self.max_cpu_loras = max_cpu_loras
        self.entries: dict[str, AdapterEntry] = {}
        self.residents: dict[int, Resident] = {}          # handle -> the content placed there
        self.resident: dict[str, int] = {}                # digest -> handle
        self._tick = itertools.count(1)
        self.num_slot_loads = 0                           # placements (registration or swap-in)
        self.num_evictions = 0                            # idle adapters freed to make room

    # -- registration ----------------------------------------------------------

    def register(self, name: str, weights: LoraWeights) -> AdapterStatus:
        """Add or replace `name` (weights already validated). Replacing a leased name
        raises AdapterInUse; a new name over --max-cpu-loras raises Overloaded, weights the store
        could never hold InvalidArgument. If the store has room the adapter is placed right away
        (evicting nothing), else on first use."""
        check_name(name)
        refused = self.bank.refusal(weights)
        if refused:
            raise InvalidArgument(f"adapter {name!r}: {refused}", param="lora_path")
        old = self.entries.get(name)
        if old is not None and old.refs:
            raise AdapterInUse(f"adapter {name!r} is used by {old.refs} active requests; it cannot be replaced "
                               f"until they finish", param="lora_name")
        if old is None and len(self.entries) >= self.max_cpu_loras:
            raise Overloaded(f"the adapter registry is full ({self.max_cpu_loras} adapters, --max-cpu-loras); "
                             f"unload one first", param="lora_name")
        self.entries[name] = AdapterEntry(name, weights)
        if old is not None:
            self._drop_orphan(old.digest)
        if weights.digest not in self.resident:
            self._place(weights)
        return self.status(name)

    def unregister(self, name: str) -> None:
        entry = self._entry(name)
        if entry.refs:
            raise AdapterInUse(f"adapter {name!r} is used by {entry.refs} active requests; it cannot be unloaded "
                               f"until they finish", param="lora_name")
        del self.entries[name]
        self._drop_orphan(entry.digest)

    def _drop_orphan(self, digest: str) -> None:
        """Free the handle of content no name refers to any more (no lease can hold it:
        leases are taken by name, and every name with this digest is gone)."""
        if any(e.digest == digest for e in self.entries.values()):
            return
        handle = self.resident.get(digest)
        if handle is not None:
            if self.residents[handle].refs:
                raise RuntimeError(f"handle {handle} leased by no registered name")  # a bookkeeping bug
            self._evict(handle)

    def _entry(self, name: str) -> AdapterEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise AdapterNotFound(f"adapter {name!r} is not loaded", param="model")
        return entry

    def resolve(self, name: str) -> AdapterEntry:
        """The entry for a request's adapter name; AdapterNotFound when unknown."""
        return self._entry(name)

    # -- leases ---------------------------------------------------------------------

    def acquire(self, name: str, digest: str) -> int | None:
        """Lease the handle holding `name`'s weights, placing them first if needed (evicting
        idle adapters, least recently used first); None when they do not fit beside the leased ones.

        digest: the content the request was admitted with (its KV salt). If the name was
        unloaded or replaced since, the request fails rather than run other weights
        under its old cache identity.
        """
        entry = self.entries.get(name)
        if entry is None or entry.digest != digest:
            raise AdapterNotFound(f"adapter {name!r} was unloaded or replaced before the request started",
                                  param="model")
        handle = self.resident.get(digest)
        if handle is None:
            handle = self._place(entry.weights, evict=True)
            if handle is None:
                return None
        held = self.residents[handle]
        held.refs += 1
        held.used = next(self._tick)
        entry.refs += 1
        return handle

    def release(self, name: str, slot: int) -> None:
        entry = self.entries.get(name)
        held = self.residents.get(slot)
        if entry is None or entry.refs < 1 or held is None or held.refs < 1 \
                or self.resident.get(entry.digest) != slot:
            raise RuntimeError(f"adapter lease {name!r} on slot {slot} released twice or never taken")
        entry.refs -= 1
        held.refs -= 1

    def _place(self, weights: LoraWeights, evict: bool = False) -> int | None:
        """Place `weights` in the store; with evict, free idle adapters (least recently used
        first) until it fits. None when it does not fit even with every idle adapter gone (then
        nothing is evicted)."""
        handle = self.bank.place(weights)
        if handle is None and evict:
            idle = sorted((h for h, r in self.residents.items() if r.refs == 0), key=lambda h: self.residents[h].used)
            if not self.bank.would_fit(weights, idle):
                return None
            for victim in idle:
                self._evict(victim)
                self.num_evictions += 1
                handle = self.bank.place(weights)
                if handle is not None:
                    break
        if handle is None:
            return None
        if handle in self.residents:
            raise RuntimeError(f"the store handed out handle {handle} twice")   # a store bug
        self.residents[handle] = Resident(weights.digest, used=next(self._tick))
        self.resident[weights.digest] = handle
        self.num_slot_loads += 1
        return handle

    def _evict(self, handle: int) -> None:
        held = self.residents.pop(handle)
        if held.refs:
            raise RuntimeError(f"handle {handle} is leased; it must not be freed")  # docs/design.md, invariant 5
        del self.resident[held.digest]
        self.bank.free(handle)

    # -- observing --------------------------------------------------------------------

    def status(self, name: str) -> AdapterStatus:
        e = self._entry(name)
        w = e.weights
        return AdapterStatus(e.name, w.digest, w.rank, w.targets, self.resident.get(w.digest, -1), e.refs)

    def list(self) -> list[AdapterStatus]:
        return [self.status(n) for n in sorted(self.entries)]

    @property
    def total_refs(self) -> int:
        return sum(r.refs for r in self.residents.values())

    @property
    def slots_in_use(self) -> int:
        """Handles placed in the store (bank slots filled, pool adapters resident)."""
        return len(self.residents)

    @property
    def slots_leased(self) -> int:
        return sum(r.refs > 0 for r in self.residents.values())
