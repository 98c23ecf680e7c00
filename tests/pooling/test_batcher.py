"""Unit tests of the dynamic batcher: overload, hold time, token budget, bucketing, order."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.common.errors import Overloaded
from services.pooling.batcher import Batcher, BatchLimits, _Item, select
from services.pooling.metrics import PoolingMetrics


class Seq(tuple):
    """A stand-in sequence: its length is its token count, its value identifies it."""


def seq(n: int, tag: int) -> Seq:
    return Seq([tag] * n)


def _run_recording(calls, delay=0.0):
    def run(seqs):
        calls.append([len(s) for s in seqs])
        time.sleep(delay)
        return torch.tensor([[float(s[0]), float(len(s))] for s in seqs])
    return run


async def _with_batcher(limits, body, delay=0.0):
    calls = []
    executor = ThreadPoolExecutor(1)
    batcher = Batcher("m", _run_recording(calls, delay), limits, executor, PoolingMetrics())
    batcher.start()
    try:
        return await body(batcher), calls
    finally:
        await batcher.close()
        executor.shutdown()


def test_select_keeps_oldest_and_buckets_by_length():
    items = [_Item(seq(n, i), n, float(i), None) for i, n in enumerate([10, 100, 11, 98, 9, 12])]
    chosen = select(items, BatchLimits(3, 10_000, 0, 100))
    assert [it.length for it in chosen] == [10, 11, 9]
    # Token budget: padded size B * longest must stay within 40 -> [10, 11, 9] is 33, adding 12 is 48.
    chosen = select(items, BatchLimits(10, 40, 0, 100))
    assert [it.length for it in chosen] == [10, 11, 9]
    # The oldest goes even when it alone exceeds the budget.
    assert select(items[1:], BatchLimits(10, 50, 0, 100))[0].length == 100


def test_results_come_back_in_order_and_batched_together():
    async def body(b):
        return await asyncio.gather(b.submit([seq(3, 1), seq(5, 2)]), b.submit([seq(4, 3)]))
    (first, second), calls = asyncio.run(_with_batcher(BatchLimits(8, 1000, 50, 100), body))
    assert [r[0].item() for r in first] == [1, 2] and second[0][0].item() == 3
    assert calls == [[3, 4, 5]]                    # one forward, nearest lengths after the oldest


def test_hold_time_waits_for_company_then_dispatches():
    async def body(b):
        first = asyncio.ensure_future(b.submit([seq(3, 1)]))
        await asyncio.sleep(0.02)                   # well inside the 300 ms hold
        second = asyncio.ensure_future(b.submit([seq(3, 2)]))
        start = time.monotonic()
        await asyncio.gather(first, second)
        return time.monotonic() - start
    waited, calls = asyncio.run(_with_batcher(BatchLimits(8, 1000, 300, 100), body))
    assert calls == [[3, 3]]                       # one forward for both
    assert waited < 1.0

    async def lone(b):
        start = time.monotonic()
        await b.submit([seq(3, 1)])
        return time.monotonic() - start
    waited, calls = asyncio.run(_with_batcher(BatchLimits(8, 1000, 100, 100), lone))
    assert calls == [[3]] and 0.09 <= waited < 1.0


def test_full_batch_goes_without_waiting_for_hold_time():
    async def body(b):
        start = time.monotonic()
        await b.submit([seq(2, i) for i in range(4)])
        return time.monotonic() - start
    waited, calls = asyncio.run(_with_batcher(BatchLimits(4, 1000, 5_000, 100), body))
    assert calls == [[2, 2, 2, 2]] and waited < 2.0


def test_token_budget_splits_forwards():
    async def body(b):
        return await b.submit([seq(10, i) for i in range(5)])
    rows, calls = asyncio.run(_with_batcher(BatchLimits(64, 25, 0, 100), body))
    assert all(len(c) <= 2 for c in calls) and sum(map(len, calls)) == 5
    assert [r[0].item() for r in rows] == [0, 1, 2, 3, 4]


def test_full_queue_is_overloaded_and_queues_nothing():
    async def body(b):
        busy = asyncio.ensure_future(b.submit([seq(2, 0)]))     # occupies the forward thread
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(b.submit([seq(2, i) for i in range(1, 4)]))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded, match="queue .* is full"):
            await b.submit([seq(2, 9), seq(2, 10)])
        depth = len(b.waiting)
        await asyncio.gather(busy, waiting)
        return depth
    depth, calls = asyncio.run(_with_batcher(BatchLimits(8, 1000, 0, 4), body, delay=0.2))
    assert depth == 3 and sum(map(len, calls)) == 4


def test_failed_forward_fails_its_callers_and_the_batcher_survives():
    def run(seqs):
        if any(s[0] < 0 for s in seqs):
            raise RuntimeError("boom")
        return torch.ones(len(seqs), 1)

    async def main():
        executor = ThreadPoolExecutor(1)
        b = Batcher("m", run, BatchLimits(1, 100, 0, 10), executor, PoolingMetrics())
        b.start()
        with pytest.raises(RuntimeError, match="boom"):
            await b.submit([seq(2, -1)])
        ok = await b.submit([seq(2, 1)])
        await b.close()
        executor.shutdown()
        return ok
    assert asyncio.run(main())[0].item() == 1.0
