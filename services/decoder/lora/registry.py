"""The host-side adapter registry: names -> weights, and which content sits in which slot.

More adapters can be registered (--max-cpu-loras, weights on the host) than fit the
device (--max-loras slots). A slot is keyed by content digest, so two names with equal
weights share one slot (and, through the digest in block hashes, their prefix KV).

A request leases its adapter's slot at admission (`acquire`) and releases it when it
finishes, aborts or fails (`release`); a preempted request keeps it. A slot with live
leases is never rewritten. When a request's adapter is not resident, `acquire` fills an
empty slot, else evicts the least recently used idle slot, else answers None: the
request keeps waiting in the queue until a lease ends.

Not thread-safe: the service runs every call on the engine thread (AsyncEngine.call),
so slot writes happen between forwards and never under a running step.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from services.common.errors import AdapterInUse, AdapterNotFound, InvalidArgument, Overloaded
from services.decoder.lora.bank import AdapterBank
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
    """What ListAdapters reports for one name. slot -1: registered, not resident."""

    name: str
    digest: str
    rank: int
    targets: tuple[str, ...]
    slot: int
    refs: int


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(f"adapter name {name!r} is invalid: 1-128 characters, letters, digits and ._:/@+- "
                              f"starting with a letter or digit", param="lora_name")


class AdapterRegistry:
    def __init__(self, bank: AdapterBank, max_cpu_loras: int):
        if max_cpu_loras < bank.num_slots:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least the slot count ({bank.num_slots})")
        self.bank = bank
        self.max_cpu_loras = max_cpu_loras
        self.entries: dict[str, AdapterEntry] = {}
        n = bank.num_slots
        self.slot_digest: list[str | None] = [None] * n   # content resident in each slot
        self.slot_refs: list[int] = [0] * n               # live leases per slot
        self.slot_used: list[int] = [0] * n               # last lease tick, for LRU eviction
        self.resident: dict[str, int] = {}                # digest -> slot
        self._tick = itertools.count(1)
        self.num_slot_loads = 0                           # slot fills (registration or swap-in)
        self.num_evictions = 0                            # fills that displaced another adapter

    # -- registration ----------------------------------------------------------

    def register(self, name: str, weights: LoraWeights) -> AdapterStatus:
        """Add or replace `name` (weights already validated). Replacing a leased name
        raises AdapterInUse; a new name over --max-cpu-loras raises Overloaded. If a
        slot is empty the adapter is placed right away, else on first use."""
        check_name(name)
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
            empty = next((s for s, d in enumerate(self.slot_digest) if d is None), None)
            if empty is not None:
                self._fill(empty, weights)
        return self.status(name)

    def unregister(self, name: str) -> None:
        entry = self._entry(name)
        if entry.refs:
            raise AdapterInUse(f"adapter {name!r} is used by {entry.refs} active requests; it cannot be unloaded "
                               f"until they finish", param="lora_name")
        del self.entries[name]
        self._drop_orphan(entry.digest)

    def _drop_orphan(self, digest: str) -> None:
        """Free the slot of content no name refers to any more (no lease can hold it:
        leases are taken by name, and every name with this digest is gone)."""
        if any(e.digest == digest for e in self.entries.values()):
            return
        slot = self.resident.pop(digest, None)
        if slot is not None:
            if self.slot_refs[slot]:
                raise RuntimeError(f"slot {slot} leased by no registered name")  # a bookkeeping bug
            self.slot_digest[slot] = None
            self.bank.clear(slot)

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
        """Lease the slot holding `name`'s weights; None when every slot is leased.

        digest: the content the request was admitted with (its KV salt). If the name was
        unloaded or replaced since, the request fails rather than run other weights
        under its old cache identity.
        """
        entry = self.entries.get(name)
        if entry is None or entry.digest != digest:
            raise AdapterNotFound(f"adapter {name!r} was unloaded or replaced before the request started",
                                  param="model")
        slot = self.resident.get(digest)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._fill(slot, entry.weights)
        self.slot_refs[slot] += 1
        self.slot_used[slot] = next(self._tick)
        entry.refs += 1
        return slot

    def release(self, name: str, slot: int) -> None:
        entry = self.entries.get(name)
        if entry is None or entry.refs < 1 or self.slot_refs[slot] < 1 \
                or self.resident.get(entry.digest) != slot:
            raise RuntimeError(f"adapter lease {name!r} on slot {slot} released twice or never taken")
        entry.refs -= 1
        self.slot_refs[slot] -= 1

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used idle one, else None."""
        empty = [s for s, d in enumerate(self.slot_digest) if d is None]
        if empty:
            return empty[0]
        idle = [s for s in range(self.bank.num_slots) if self.slot_refs[s] == 0]
        if not idle:
            return None
        victim = min(idle, key=lambda s: self.slot_used[s])
        del self.resident[self.slot_digest[victim]]
        self.slot_digest[victim] = None
        self.num_evictions += 1
        return victim

    def _fill(self, slot: int, weights: LoraWeights) -> None:
        if self.slot_refs[slot]:
            raise RuntimeError(f"slot {slot} is leased; it must not be rewritten")  # docs/design.md, invariant 5
        self.bank.write(slot, weights)
        self.slot_digest[slot] = weights.digest
        self.resident[weights.digest] = slot
        self.slot_used[slot] = next(self._tick)
        self.num_slot_loads += 1

    # -- observing --------------------------------------------------------------------

    def status(self, name: str) -> AdapterStatus:
        e = self._entry(name)
        w = e.weights
        return AdapterStatus(e.name, w.digest, w.rank, w.targets, self.resident.get(w.digest, -1), e.refs)

    def list(self) -> list[AdapterStatus]:
        return [self.status(n) for n in sorted(self.entries)]

    @property
    def total_refs(self) -> int:
        return sum(self.slot_refs)

    @property
    def slots_in_use(self) -> int:
        return sum(d is not None for d in self.slot_digest)

    @property
    def slots_leased(self) -> int:
        return sum(r > 0 for r in self.slot_refs)
