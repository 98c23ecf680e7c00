"""The engine's `Leases` hook over the adapter registry, plus the request features it uses.

A request that names an adapter carries, from Generate on:
    features[LORA_NAME]   the adapter name
    features[LORA_DIGEST] the content digest it was admitted with (also in its extra_keys)
and, once the scheduler admitted it, features[LORA_SLOT] = the leased slot, which the
runner reads. Base-model requests carry none of these and cost one dict lookup here.
"""
from __future__ import annotations

from collections import Counter

from services.decoder.engine.request import Request
from services.decoder.lora.registry import AdapterRegistry

LORA_NAME = "lora_name"
LORA_DIGEST = "lora_digest"
LORA_SLOT = "lora_slot"


def adapter_features(name: str, digest: str) -> tuple[dict[str, str], tuple]:
    """(features, extra_keys) for a request using adapter `name` with content `digest`.

    The digest, never the name or a slot, salts every block hash (docs/design.md, invariant 4).
    """
    return {LORA_NAME: name, LORA_DIGEST: digest}, (("lora", digest),)


class AdapterLeases:
    """Leases protocol: acquire at first admission, release once on finish/abort/error."""

    def __init__(self, registry: AdapterRegistry):
        self.registry = registry

    def acquire(self, request: Request) -> bool:
        name = request.features.get(LORA_NAME)
        if name is None:
            return True
        slot = self.registry.acquire(name, request.features[LORA_DIGEST])
        if slot is None:
            return False        # every slot is leased: wait in the queue for one to free up
        request.features[LORA_SLOT] = slot
        return True

    def release(self, request: Request) -> None:
        name = request.features.get(LORA_NAME)
        if name is None:
            return
        self.registry.release(name, request.features.pop(LORA_SLOT))


def requests_per_adapter(requests) -> Counter:
    """adapter name -> count over requests (base-model requests are not counted)."""
    return Counter(r.features[LORA_NAME] for r in requests if LORA_NAME in r.features)
