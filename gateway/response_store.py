"""Stored Responses API answers (`store`, `previous_response_id`, GET and DELETE /v1/responses/{id}) in the
fleet's Redis, per tenant (gateway/tenants.py: a key of --api-key is a tenant of its own, the keys of one
--api-key-file tenant share its responses), so one tenant can never read, continue or delete another's responses
(another tenant's id is a plain 404). Without authentication the tenant is a hash of whatever key is sent.

Each tenant's responses are bounded twice: every record expires after --response-store-ttl-s, and a tenant
holds at most --response-store-max-bytes (storing past it evicts that tenant's oldest records first, one Lua
script so concurrent stores cannot overshoot). A record is one JSON value: the response as answered, plus
`items`, the whole conversation that led to it (earlier items, this input, this output), which is what a
continuation prepends to its own input, function calls and their outputs included.

Unlike the vision cache (a cache: Redis trouble means computing again), a store that fails is an answer the
caller must see: any Redis error is Unavailable (503) naming the store.
"""
from __future__ import annotations

import hashlib
import json
import logging

from redis import asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from services.common.errors import InvalidArgument, Unavailable

log = logging.getLogger("tessera.gateway.response_store")

# KEYS: record, order, sizes, bytes. ARGV: id, value, ttl_ms, budget, record key prefix. Returns bytes held.
_PUT = """
local size = string.len(ARGV[2])
local t = redis.call('TIME')
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], size)
redis.call('ZADD', KEYS[2], t[1] * 1000000 + t[2], ARGV[1])
local total = redis.call('INCRBY', KEYS[4], size)
while total > tonumber(ARGV[4]) do
  local popped = redis.call('ZPOPMIN', KEYS[2])
  if #popped == 0 or popped[1] == ARGV[1] then break end
  local s = redis.call('HGET', KEYS[3], popped[1])
  redis.call('HDEL', KEYS[3], popped[1])
  redis.call('DEL', ARGV[5] .. popped[1])
  if s then total = redis.call('DECRBY', KEYS[4], s) end
end
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return total
"""

# KEYS: record, order, sizes, bytes. ARGV: id. Returns 1 if it was there.
_DELETE = """
local s = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
if s then redis.call('DECRBY', KEYS[4], s) end
return redis.call('DEL', KEYS[1])
"""


def tenant(api_key: str | None) -> str:
    """The store's name for the key a request came with (the key itself is never stored)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()[:32]


class ResponseStore:
    """get / put / delete of response records by (tenant, response id)."""

    def __init__(self, url: str, *, ttl_s: int, max_bytes: int, prefix: str = "tessera:responses",
                 timeout_s: float = 1.0):
        self.ttl_ms, self.max_bytes, self.prefix = ttl_s * 1000, max_bytes, prefix
        # No retries: a down Redis must be one quick 503, not a hung request.
        self.redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                             retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        self._put = self.redis.register_script(_PUT)
        self._delete = self.redis.register_script(_DELETE)

    def _keys(self, who: str, response_id: str) -> list[str]:
        base = f"{self.prefix}:{who}"
        return [f"{base}:r:{response_id}", f"{base}:order", f"{base}:sizes", f"{base}:bytes"]

    async def put(self, who: str, response_id: str, record: dict) -> None:
        value = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        if len(value.encode()) > self.max_bytes:
            raise InvalidArgument(f"this response ({len(value.encode())} bytes with its conversation) is over the"
                                  f" store's {self.max_bytes}-byte budget: send store: false", param="store")
        try:
            await self._put(keys=self._keys(who, response_id),
                            args=[response_id, value, self.ttl_ms, self.max_bytes, f"{self.prefix}:{who}:r:"])
        except (RedisError, OSError) as exc:
            raise _down(exc) from None

    async def get(self, who: str, response_id: str) -> dict | None:
        try:
            value = await self.redis.get(self._keys(who, response_id)[0])
        except (RedisError, OSError) as exc:
            raise _down(exc) from None
        return None if value is None else json.loads(value)

    async def delete(self, who: str, response_id: str) -> bool:
        try:
            return bool(await self._delete(keys=self._keys(who, response_id), args=[response_id]))
        except (RedisError, OSError) as exc:
            raise _down(exc) from None

    async def ping(self) -> None:
        try:
            await self.redis.ping()
        except (RedisError, OSError) as exc:
            raise _down(exc) from None

    async def close(self) -> None:
        await self.redis.aclose()


def _down(exc: Exception) -> Unavailable:
    # The exception names Redis's address: the log has it, the caller's error does not.
    log.warning("the response store (Redis) is unavailable: %s: %s", type(exc).__name__, exc)
    return Unavailable("the response store (Redis) is unavailable; retry later", param="store")
