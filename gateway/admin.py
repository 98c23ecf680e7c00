"""Who may call the admin endpoints: a separate admin key, checked by the edge before the body is read.

The API key (--api-key) lets a caller generate; loading and unloading adapters changes what every caller
is served, so it needs the admin key (--admin-key / TESSERA_GATEWAY_ADMIN_KEY) instead. No key: 401. Any other
key, the API key included: 403. No admin key configured: the endpoints are off, and say how to turn
them on (403), rather than being open to everyone.
"""
from __future__ import annotations

import hmac

from services.common.errors import PermissionDenied, Unauthenticated

ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/lora_adapters"})


def is_admin(admin_key: bytes | None, headers) -> bool:
    """Whether headers (any mapping with lower-case names) carry `Authorization: Bearer <admin key>`; False when
    there is no admin key. For public routes that tell the admin more than anyone else (/ready)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return admin_key is not None and scheme.lower() == "bearer" and \
        hmac.compare_digest(token.strip().encode(), admin_key)


def authorize(admin_key: bytes | None, headers: dict[str, str]) -> None:
    """Raise unless headers carry `Authorization: Bearer <admin key>` (headers: lower-cased names)."""
    if admin_key is None:
        raise PermissionDenied("the admin endpoints are disabled: start the gateway with --admin-key KEY "
                               "(or TESSERA_GATEWAY_ADMIN_KEY) to load and unload adapters at run time")
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("missing admin key: send 'Authorization: Bearer <admin key>'")
    if not hmac.compare_digest(token.strip().encode(), admin_key):
        raise PermissionDenied("this key may not use the admin endpoints: they need the admin key")
