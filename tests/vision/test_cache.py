"""The Redis feature cache against a real redis-server: round trip, byte budget LRU, TTL, outage."""
from __future__ import annotations

import asyncio

import pytest
import redis
import torch

from services.vision.cache import Entry, FeatureCache, pack, unpack


def entry(n: int, seed: int = 0) -> Entry:
    g = torch.Generator().manual_seed(seed)
    return Entry(torch.randn(n, 8, generator=g), (1, 1, n))


def run(coro):
    return asyncio.run(coro)


def test_pack_round_trip_and_corruption():
    e = entry(6)
    back = unpack(pack(e))
    assert torch.equal(back.rows, e.rows) and back.grid == e.grid
    with pytest.raises(ValueError):
        unpack(pack(e)[:-4])


def test_hit_miss_and_lru_eviction_under_budget(redis_server):
    size = len(pack(entry(4)))

    async def go():
        cache = FeatureCache(redis_server, budget_bytes=3 * size, ttl_s=60, prefix="t")
        try:
            assert await cache.get("a") is None
            for i, key in enumerate("abc"):
                assert await cache.put(key, entry(4, i))
            got = await cache.get("a")  # a becomes most recently used; b is now the oldest
            assert got is not None and torch.equal(got.rows, entry(4, 0).rows)
            assert await cache.put("d", entry(4, 3))
            assert await cache.get("b") is None
            assert all([await cache.get(k) is not None for k in "acd"])
            assert cache.stats.evictions == 1 and cache.stats.bytes == 3 * size
            assert not await cache.put("huge", entry(4 * 4))  # larger than the whole budget
            return cache.stats
        finally:
            await cache.close()

    stats = run(go())
    r = redis.Redis.from_url(redis_server)
    assert int(r.get("t:bytes")) == 3 * size == sum(int(v) for v in r.hvals("t:sizes"))
    assert r.zcard("t:lru") == 3 and not r.exists("t:rows:b")
    assert stats.hits == 4 and stats.misses == 2 and stats.errors == 0


def test_ttl_expiry_reclaims_bookkeeping(redis_server):
    async def go():
        cache = FeatureCache(redis_server, budget_bytes=1 << 20, ttl_s=1, prefix="ttl")
        try:
            await cache.put("x", entry(2))
            await asyncio.sleep(1.2)
            assert await cache.get("x") is None
        finally:
            await cache.close()

    run(go())
    r = redis.Redis.from_url(redis_server)
    assert int(r.get("ttl:bytes")) == 0 and r.zcard("ttl:lru") == 0


def test_outage_is_counted_and_backed_off(redis_server):
    async def go():
        cache = FeatureCache(redis_server, budget_bytes=1 << 20, ttl_s=60, prefix="o", backoff_s=0.3)
        try:
            assert await cache.put("x", entry(2))
            redis.Redis.from_url(redis_server).shutdown(nosave=True)
            assert await cache.get("x") is None and cache.stats.errors == 1
            assert await cache.get("x") is None and cache.stats.bypassed == 1  # no second timeout
            await asyncio.sleep(0.35)
            assert not await cache.put("y", entry(2)) and cache.stats.errors == 2
        finally:
            await cache.close()

    run(go())
