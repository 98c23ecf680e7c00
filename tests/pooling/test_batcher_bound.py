"""The batcher's wait bound (services/pooling/batcher.py docstring), in virtual time with a fake
forward of fixed duration F: every sequence starts its forward after at most P(q) other forwards and
within max_wait_ms + (P(q) + 1) * F of being queued, and at most P(q) * (max_batch_size - 1) later
arrivals start before it."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from services.pooling.batcher import Batcher, BatchLimits
from services.pooling.metrics import PoolingMetrics
from tests.pooling.virtual import SimulatedDevice, run_virtual

LONGEST = 32   # L: the longest sequence the fake model accepts


@dataclass(frozen=True, eq=False)
class FakeSeq:
    tag: int      # queue order over the whole run
    n: int        # tokens

    def __len__(self) -> int:
        return self.n


def passes_bound(q: int, limits: BatchLimits, longest: int = LONGEST) -> int:
    """P(q) as the batcher docstring states it."""
    m = max(1, min(limits.max_batch_size, limits.max_batch_tokens // longest))
    k = limits.max_passes
    return min(q, k - 1 + math.ceil((q + 1 - k) / m))


@dataclass
class Trace:
    queued: dict = field(default_factory=dict)     # tag -> (virtual time, q, forwards started before)
    forwards: list = field(default_factory=list)   # [(start time, [tags])]


def simulate(limits: BatchLimits, requests: list[tuple[float, list[int]]], forward_s: float,
             adversary=None) -> Trace:
    """Queue each request (lengths) gap seconds after the previous one; every forward takes
    forward_s. adversary(batcher, submit) runs at each forward start and may queue more."""
    async def main(loop):
        trace, tags = Trace(), iter(range(1 << 30))
        calls = []

        def run(seqs):
            trace.forwards.append((loop.time(), [s.tag for s in seqs]))
            if adversary is not None:
                adversary(batcher, submit)
            return [s.tag for s in seqs]

        async def client(seqs):
            # No await between this and submit() queueing them: q is exact.
            for i, s in enumerate(seqs):
                trace.queued[s.tag] = (loop.time(), len(batcher.waiting) + i, len(trace.forwards))
            assert await batcher.submit(seqs) == [s.tag for s in seqs]

        def submit(lengths):
            calls.append(loop.create_task(client([FakeSeq(next(tags), n) for n in lengths])))

        batcher = Batcher("m", run, limits, SimulatedDevice(loop, forward_s), PoolingMetrics())
        batcher.start()
        for gap, lengths in requests:
            await asyncio.sleep(gap)
            submit(lengths)
        while calls:
            await calls.pop(0)
        await batcher.close()
        return trace
    return run_virtual(main)


def check_bound(trace: Trace, limits: BatchLimits, forward_s: float) -> dict[int, int]:
    """Assert the three parts of the bound for every sequence; return its passes."""
    placed = {tag: (i, start) for i, (start, tags) in enumerate(trace.forwards) for tag in tags}
    assert sorted(placed) == sorted(trace.queued)           # every sequence ran, exactly once
    passes = {}
    for tag, (queued, q, before) in trace.queued.items():
        index, start = placed[tag]
        passes[tag] = index - before
        assert passes[tag] <= passes_bound(q, limits), (tag, q, passes[tag])
        # The stronger form (actual passes, not their bound): the loop idles at most max_wait_ms.
        assert start - queued <= limits.max_wait_ms / 1000 + (passes[tag] + 1) * forward_s + 1e-9, tag
        overtaken = sum(1 for later, (i, _) in placed.items() if later > tag and i < index)
        assert overtaken <= passes[tag] * (limits.max_batch_size - 1), (tag, overtaken)
    for _, tags in trace.forwards:
        assert len(tags) <= limits.max_batch_size
    return passes


limits_strategy = st.builds(
    BatchLimits, max_batch_size=st.integers(1, 8), max_batch_tokens=st.integers(1, 8 * LONGEST),
    max_wait_ms=st.sampled_from([0.0, 1.0, 5.0, 20.0]), max_queue=st.just(100_000), max_passes=st.integers(0, 5))
requests_strategy = st.lists(
    st.tuples(st.integers(0, 12).map(lambda ms: ms / 1000), st.lists(st.integers(1, LONGEST), min_size=1, max_size=5)),
    min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(limits=limits_strategy, requests=requests_strategy, forward_ms=st.sampled_from([1, 4, 10]))
def test_every_sequence_is_served_within_the_bound(limits, requests, forward_ms):
    trace = simulate(limits, requests, forward_ms / 1000)
    check_bound(trace, limits, forward_ms / 1000)


def _starve(max_passes: int) -> tuple[int, Trace]:
    """16 sequences of lengths 10..25 and then a long one (30) are queued at once. During every
    forward three newcomers arrive with exactly the next oldest's length, so pure bucketing keeps
    picking them over whatever waits ahead. Returns the long one's passes."""
    limits = BatchLimits(4, 10_000, 0, 10_000, max_passes)

    def adversary(batcher, submit):
        if batcher.waiting and batcher.waiting[0].length != 30:
            submit([batcher.waiting[0].length] * 3)

    trace = simulate(limits, [(0.0, [*range(10, 26), 30])], 0.01, adversary)
    return check_bound(trace, limits, 0.01)[16], trace


def test_a_long_sequence_is_not_starved_by_shorter_neighbours():
    # Pure bucketing (the old rule): every forward takes one sequence ahead of the long one and
    # three newcomers, so it waits for all 16 ahead: 13 forwards pass it.
    passes, _ = _starve(max_passes=1_000)
    assert passes == 13
    # Overdue after 2 passes: everything ahead goes in arrival order, 4 a forward (P(16) = 5).
    passes, trace = _starve(max_passes=2)
    assert passes == 4 <= passes_bound(16, BatchLimits(4, 10_000, 0, 10_000, 2))
    assert trace.forwards[2][1] == [5, 6, 7, 8]            # the overdue prefix, in order


def test_strict_fifo_when_max_passes_is_zero():
    limits = BatchLimits(3, 10_000, 0, 10_000, 0)
    trace = simulate(limits, [(0.0, [5, 30, 6, 29, 7, 28, 8])], 0.01)
    assert [tags for _, tags in trace.forwards] == [[0, 1, 2], [3, 4, 5], [6]]
