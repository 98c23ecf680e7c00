"""Unit tests of the dynamic batcher: overload, hold time, token budget, bucketing, order, overdue
sequences, and the failure policy (a refused batch fails alone; a dead worker fails everyone)."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.common.errors import Internal, InvalidArgument, Overloaded, Unavailable
from services.pooling.batcher import Batcher, BatchLimits, Span, _Item, select
from services.pooling.metrics import PoolingMetrics
from tests.pooling.virtual import SimulatedDevice, run_virtual


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


def test_select_takes_overdue_sequences_first_in_arrival_order():
    # passed counts: the three oldest are overdue (>= 2); bucketing by the oldest's length (30)
    # would otherwise pick the 29 and 31 over the 5 and 6.
    items = [_Item(seq(n, i), n, float(i), None, passed=p)
             for i, (n, p) in enumerate([(30, 3), (5, 2), (6, 2), (29, 1), (31, 0), (4, 0)])]
    assert [it.length for it in select(items, BatchLimits(4, 10_000, 0, 100, max_passes=2))] == [30, 5, 6, 29]
    # The budget stops the overdue prefix at the first that does not fit (40: 2 x 40 > 70), then the
    # rest fills by length as before: the 29 (2 x 30 <= 70), nothing more fits.
    items[1].length = 40
    assert [it.length for it in select(items, BatchLimits(4, 70, 0, 100, max_passes=2))] == [30, 29]
    # Pure bucketing when nothing is overdue.
    assert [it.length for it in select(items, BatchLimits(3, 10_000, 0, 100, max_passes=9))] == [30, 29, 31]


def _refusing(exc):
    def run(seqs):
        if any(s[0] < 0 for s in seqs):
            raise exc
        return torch.ones(len(seqs), 1)
    return run


@pytest.mark.parametrize("exc, expected", [(ValueError("bad shape"), Internal),
                                           (InvalidArgument("no"), InvalidArgument)])
def test_refused_input_fails_only_its_batch_and_the_batcher_survives(exc, expected):
    """Policy: a forward raising ValueError or a TesseraError fails that batch's requests (its
    batch-mates too), and nothing else: no on_failure, later requests are served."""
    failures = []

    async def on_failure(reason):
        failures.append(reason)

    async def main():
        executor = ThreadPoolExecutor(1)
        b = Batcher("m", _refusing(exc), BatchLimits(4, 100, 50, 10), executor, PoolingMetrics(), on_failure)
        b.start()
        bad, mate = await asyncio.gather(b.submit([seq(2, -1)]), b.submit([seq(2, 1)]), return_exceptions=True)
        ok = await b.submit([seq(2, 1)])
        await b.close()
        executor.shutdown()
        return bad, mate, ok, b.failed
    bad, mate, ok, failed = asyncio.run(main())
    assert type(bad) is expected and type(mate) is expected      # one forward: both in it
    assert ok[0].item() == 1.0 and failed is None and failures == []


def test_worker_failure_reports_first_then_fails_running_and_queued():
    """Policy: any other exception kills the batcher. on_failure runs before any caller hears;
    the running batch gets INTERNAL, the queued ones UNAVAILABLE, new ones UNAVAILABLE at once."""
    events = []

    async def main(loop):
        async def on_failure(reason):
            events.append(("on_failure", reason))
            await asyncio.sleep(0)       # a real one awaits the health servicer

        def run(seqs):
            raise RuntimeError("device lost")

        b = Batcher("m", run, BatchLimits(1, 100, 0, 10), SimulatedDevice(loop, 0.01), PoolingMetrics(), on_failure)
        b.start()
        calls = [loop.create_task(b.submit([seq(2, i)])) for i in range(3)]
        for call in calls:
            call.add_done_callback(lambda c: events.append(("failed", type(c.exception()).__name__)))
        await asyncio.sleep(0.001)       # the first is in the forward, two wait
        assert len(b.running) == 1 and len(b.waiting) == 2
        results = await asyncio.gather(*calls, return_exceptions=True)
        refused_at = loop.time()
        with pytest.raises(Unavailable, match="stopped serving after a failed forward"):
            await b.submit([seq(2, 9)])
        assert loop.time() == refused_at  # at once, no wait
        await b.close()
        return results, b.failed
    results, failed = run_virtual(main)
    assert [type(r) for r in results] == [Internal, Unavailable, Unavailable]
    assert "device lost" in str(results[0]) and failed == "RuntimeError: device lost"
    assert events[0] == ("on_failure", "RuntimeError: device lost") and len(events) == 4


def test_a_bug_in_the_loop_kills_the_batcher_instead_of_hanging(monkeypatch):
    import services.pooling.batcher as batcher_module

    def broken(items, limits):
        raise KeyError("bug")
    monkeypatch.setattr(batcher_module, "select", broken)

    async def main(loop):
        b = Batcher("m", lambda seqs: [0] * len(seqs), BatchLimits(1, 100, 0, 10), SimulatedDevice(loop, 0.01),
                    PoolingMetrics())
        b.start()
        with pytest.raises(Unavailable, match="KeyError"):
            await b.submit([seq(2, 0)])
        await b.close()
    run_virtual(main)


def test_fail_stops_a_sibling_batcher():
    """server.py calls fail() on every batcher of the device when one dies."""
    async def main(loop):
        b = Batcher("m", lambda seqs: [0] * len(seqs), BatchLimits(1, 100, 0, 10), SimulatedDevice(loop, 0.01),
                    PoolingMetrics())
        b.start()
        calls = [loop.create_task(b.submit([seq(2, i)])) for i in range(2)]
        await asyncio.sleep(0.001)       # one running, one waiting
        b.fail("the reranker's forward failed")
        results = await asyncio.gather(*calls, return_exceptions=True)
        with pytest.raises(Unavailable):
            await b.submit([seq(2, 3)])
        await b.close()
        return results, b.task.cancelled()
    results, cancelled = run_virtual(main)
    assert [type(r) for r in results] == [Unavailable, Unavailable] and cancelled


def test_span_says_when_the_forwards_holding_a_request_ran():
    """A request split over two forwards by the token budget: its span starts with the first forward and
    ends (with that forward's batch size) with the second, as stamped in the forward thread."""
    stamps = []

    def run(seqs):
        start = time.monotonic_ns()
        rows = torch.tensor([[float(len(s))] for s in seqs])
        stamps.append((start, time.monotonic_ns(), len(seqs)))
        return rows

    async def main():
        executor = ThreadPoolExecutor(1)
        batcher = Batcher("m", run, BatchLimits(8, 10, 0, 100), executor, PoolingMetrics())
        batcher.start()
        try:
            split, alone = Span(), Span()
            # Padded budget 10: the 6 goes alone (6 x 2 > 10), then both 4s share the second forward.
            await asyncio.gather(batcher.submit([seq(6, 1), seq(4, 2)], split), batcher.submit([seq(4, 3)], alone))
            return split, alone
        finally:
            await batcher.close()
            executor.shutdown()
    split, alone = asyncio.run(main())
    (first_start, first_end, _), (second_start, second_end, second_size) = stamps
    # The batcher stamps just outside run(), which stamps its own inside.
    assert split.start_ns <= first_start < first_end <= alone.start_ns <= second_start
    assert second_end <= split.end_ns == alone.end_ns
    assert split.batch_size == alone.batch_size == second_size == 2
