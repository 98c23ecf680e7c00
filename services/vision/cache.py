"""The Redis feature cache: projected rows stored under their content hash, bounded and best-effort.

A request's cache_salt (EncodeRequest.cache_salt; the gateway sends one per tenant) salts the key
(`cache_key`), so requests with different salts never hit each other's rows: a hit, and the time it saves, says
nothing about another tenant's images. The salted key is a hash too, so the layout below is the same.

Layout under a prefix P (one per encoder deployment):
  P:rows:<hash>   the entry: header length (4 bytes LE) + JSON {dtype, shape, grid} + raw rows; TTL'd
  P:lru           sorted set: hash -> last access time (Redis TIME, microseconds)
  P:sizes         hash: hash -> entry bytes
  P:bytes         the byte counter: sum of P:sizes

Both scripts run atomically inside Redis, so the counter, the sizes and the LRU
order never disagree however many service replicas share the cache. `put`
evicts least recently used entries until the counter fits the byte budget.
Entries that expired by TTL were touched longer ago than any live entry (a hit
refreshes both TTL and access time), so they sort first and eviction reclaims
their bookkeeping before any live entry; a `get` that misses also reclaims it.

A Redis error never fails a request: it is logged and counted, and the cache is
bypassed for `backoff_s`, so an outage costs one short timeout, not one per call.
"""
from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from dataclasses import dataclass

import numpy as np
import torch
from prometheus_client import Counter, Gauge
from redis import asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError
from redis.retry import Retry

log = logging.getLogger("tessera.vision.cache")

_HITS = Counter("tessera_vision_cache_hits", "feature cache hits")
_MISSES = Counter("tessera_vision_cache_misses", "feature cache misses")
_ERRORS = Counter("tessera_vision_cache_errors", "feature cache Redis errors (requests were still served)")
_BYPASSED = Counter("tessera_vision_cache_bypassed", "lookups skipped while Redis was backing off after an error")
_EVICTIONS = Counter("tessera_vision_cache_evictions", "entries evicted to stay under the byte budget")
_BYTES = Gauge("tessera_vision_cache_bytes", "bytes of rows held in the feature cache (last seen)")
_WRITTEN = Counter("tessera_vision_cache_written_bytes", "bytes of rows written to the feature cache")

# KEYS: entry, lru, sizes, bytes. ARGV: member, ttl_ms.
_GET = """
local v = redis.call('GET', KEYS[1])
if v then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[2], t[1] * 1000000 + t[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return v
end
local size = redis.call('HGET', KEYS[3], ARGV[1])
if size then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DECRBY', KEYS[4], size)
end
return false
"""

# KEYS: entry, lru, sizes, bytes. ARGV: member, value, ttl_ms, budget, entry key prefix.
# Returns {stored (0/1), bytes held, entries evicted}.
_PUT = """
local size = string.len(ARGV[2])
local budget = tonumber(ARGV[4])
if size > budget then
  return {0, tonumber(redis.call('GET', KEYS[4]) or '0'), 0}
end
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], size)
redis.call('ZADD', KEYS[2], now, ARGV[1])
local total = redis.call('INCRBY', KEYS[4], size)
local evicted = 0
while total > budget do
  local popped = redis.call('ZPOPMIN', KEYS[2])
  if #popped == 0 then break end
  local member = popped[1]
  if member == ARGV[1] then
    redis.call('ZADD', KEYS[2], now, member)
    break
  end
  local s = redis.call('HGET', KEYS[3], member)
  redis.call('HDEL', KEYS[3], member)
  redis.call('DEL', ARGV[5] .. member)
  if s then total = redis.call('DECRBY', KEYS[4], s) end
  evicted = evicted + 1
end
return {1, total, evicted}
"""


def cache_key(content_hash: str, salt: str) -> str:
    """The key of an image's rows for requests with this salt: its content hash itself when unsalted."""
    if not salt:
        return content_hash
    return hashlib.sha256(f"{salt}\x00{content_hash}".encode()).hexdigest()


@dataclass
class Entry:
    """Cached rows [t*h*w, hidden] float32 and their (merged) grid."""

    rows: torch.Tensor
    grid: tuple[int, int, int]


def pack(entry: Entry) -> bytes:
    rows = entry.rows.detach().to("cpu", torch.float32).contiguous()
    header = json.dumps({"dtype": "float32", "shape": list(rows.shape), "grid": list(entry.grid)}).encode()
    return struct.pack("<I", len(header)) + header + rows.numpy().tobytes()


def unpack(value: bytes) -> Entry:
    """Inverse of pack; ValueError on anything malformed (a corrupt entry is a miss, never a crash)."""
    if len(value) < 4:
        raise ValueError("entry too short")
    (n,) = struct.unpack_from("<I", value)
    header = json.loads(value[4:4 + n])
    shape, grid = [int(d) for d in header["shape"]], tuple(int(g) for g in header["grid"])
    data = value[4 + n:]
    if header["dtype"] != "float32" or len(shape) != 2 or len(grid) != 3 or \
            len(data) != shape[0] * shape[1] * 4 or grid[0] * grid[1] * grid[2] != shape[0]:
        raise ValueError("entry header does not match its data")
    rows = torch.from_numpy(np.frombuffer(data, dtype="<f4").copy()).reshape(shape)
    return Entry(rows, grid)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    errors: int = 0
    bypassed: int = 0
    evictions: int = 0
    bytes: int = 0


class FeatureCache:
    """Async get/put of Entry by content hash in Redis, bounded by budget_bytes, never raising RedisError."""

    def __init__(self, url: str, *, budget_bytes: int, ttl_s: int, prefix: str = "tessera:vision",
                 timeout_s: float = 0.25, backoff_s: float = 2.0, password: str | None = None):
        self.budget, self.ttl_ms, self.backoff_s = budget_bytes, ttl_s * 1000, backoff_s
        self.prefix = prefix
        self.keys = [f"{prefix}:lru", f"{prefix}:sizes", f"{prefix}:bytes"]
        # No retries and short timeouts: a down Redis must cost one quick failure, then the backoff.
        self.redis = aioredis.Redis.from_url(url, password=password, socket_timeout=timeout_s,
                                             socket_connect_timeout=timeout_s,
                                             retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        self._get = self.redis.register_script(_GET)
        self._put = self.redis.register_script(_PUT)
        self._down_until = 0.0
        self.stats = CacheStats()

    async def check_credentials(self) -> None:
        """At start: a Redis that refuses our credentials (no password, a wrong one, one it does not expect)
        is a configuration error, a ValueError in one line; a Redis that is down is not (the service computes
        without the cache until it is back)."""
        try:
            await self.redis.ping()
        except AuthenticationError as exc:
            host = self.redis.connection_pool.connection_kwargs.get("host", "?")
            port = self.redis.connection_pool.connection_kwargs.get("port", "?")
            raise ValueError(f"redis at {host}:{port} refused our credentials ({exc}): check"
                             " --redis-password-file against the server's requirepass") from None
        except (RedisError, OSError) as exc:
            self._failed("start-up ping", exc)

    def entry_key(self, content_hash: str) -> str:
        return f"{self.prefix}:rows:{content_hash}"

    def _available(self) -> bool:
        if time.monotonic() < self._down_until:
            self.stats.bypassed += 1
            _BYPASSED.inc()
            return False
        return True

    def _failed(self, op: str, exc: Exception) -> None:
        self.stats.errors += 1
        _ERRORS.inc()
        self._down_until = time.monotonic() + self.backoff_s
        log.warning("feature cache %s failed (%s: %s); computing without the cache for %.1fs",
                    op, type(exc).__name__, exc, self.backoff_s)

    async def get(self, content_hash: str) -> Entry | None:
        """The cached entry, or None on a miss, a corrupt entry or any Redis trouble."""
        if not self._available():
            return None
        try:
            value = await self._get(keys=[self.entry_key(content_hash), *self.keys], args=[content_hash, self.ttl_ms])
        except (RedisError, OSError) as exc:
            self._failed("get", exc)
            return None
        if value is None:
            self.stats.misses += 1
            _MISSES.inc()
            return None
        try:
            entry = unpack(value)
        except (ValueError, KeyError, TypeError) as exc:
            self.stats.errors += 1
            _ERRORS.inc()
            log.warning("feature cache entry %s is corrupt (%s); recomputing", content_hash[:16], exc)
            return None
        self.stats.hits += 1
        _HITS.inc()
        return entry

    async def put(self, content_hash: str, entry: Entry) -> bool:
        """Store entry (evicting LRU entries past the budget); False if not stored."""
        if not self._available():
            return False
        value = pack(entry)
        try:
            stored, total, evicted = await self._put(
                keys=[self.entry_key(content_hash), *self.keys],
                args=[content_hash, value, self.ttl_ms, self.budget, f"{self.prefix}:rows:"])
        except (RedisError, OSError) as exc:
            self._failed("put", exc)
            return False
        self.stats.bytes = int(total)
        self.stats.evictions += int(evicted)
        _BYTES.set(int(total))
        _EVICTIONS.inc(int(evicted))
        if stored:
            _WRITTEN.inc(len(value))
        else:
            log.info("entry %s (%d bytes) exceeds the whole cache budget; not cached", content_hash[:16], len(value))
        return bool(stored)

    async def close(self) -> None:
        await self.redis.aclose()
