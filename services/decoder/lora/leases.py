"""The engine's `Leases` hook over the adapter registry.

A request that names an adapter carries an AdapterRef (engine/request.py) from Generate on: the
adapter's name and the content digest it was admitted with (also in its extra_keys). Once the
scheduler admits it, the lease sets AdapterRef.slot to the slot it holds, which the runner reads
from each chunk; release clears it. Base-model requests carry no AdapterRef and cost one attribute
read here.
"""
from __future__ import annotations

from services.decoder.engine.request import AdapterRef, Request
from services.decoder.lora.registry import AdapterRegistry


def adapter_request(name: str, digest: str) -> tuple[AdapterRef, tuple]:
    """(adapter, extra_keys) for a request using adapter `name` with content `digest`.

    The digest, never the name or a slot, salts every block hash (docs/design.md, invariant 4): a reload under the
    same name with other weights can never hit the old weights' cached KV.
    """
    return AdapterRef(name, digest), (("lora", digest),)


class AdapterLeases:
    """Leases protocol: acquire at first admission, release once on finish/abort/error."""

    def __init__(self, registry: AdapterRegistry):
        self.registry = registry

    def acquire(self, request: Request) -> bool:
        adapter = request.adapter
        if adapter is None:
            return True
        slot = self.registry.acquire(adapter.name, adapter.digest)
        if slot is None:
            return False        # every slot is leased: wait in the queue for one to free up
        adapter.slot = slot
        return True

    def release(self, request: Request) -> None:
        adapter = request.adapter
        if adapter is None:
            return
        slot, adapter.slot = adapter.slot, None
        self.registry.release(adapter.name, slot)
