"""Dynamic batching: a bounded queue, a per-forward token budget, a maximum hold time,
length bucketing, and one forward at a time per device in a worker thread.

Selection. A request puts its sequences in the queue and awaits their rows. Each forward
takes the oldest waiting sequence, then the waiting sequences closest to it in length while
the padded size B * longest stays within the token budget, so padding stays small. A
sequence that `max_passes` forwards have started without is overdue: overdue sequences go
first, in arrival order, so bucketing reorders the queue only within a bound.

The bound. For a sequence s let q = the sequences waiting ahead of it when it is queued
(earlier arrivals not yet in a forward, earlier sequences of its own request included),
K = max_passes, L = the longest sequence the model accepts (max_model_len) and
m = max(1, min(max_batch_size, max_batch_tokens // L)), the overdue sequences every
forward is sure to take. Then:

- Forwards: at most P(q) = min(q, K - 1 + ceil((q + 1 - K) / m)) forwards start after s is
  queued and before its own. Every forward takes the oldest, one of the q, so at most q;
  after K of them s is overdue, and so is every sequence still ahead of it (an older waiting
  sequence was left out of every forward that left s out); at most q - K remain, and each
  forward takes the next m of them.
- Time: the loop holds only while the oldest waiting sequence is younger than max_wait_ms,
  and that one is never younger than s. With forwards of at most F seconds, s starts its
  forward within max_wait_ms + (P(q) + 1) * F of being queued (+1: the forward already
  running then). A request ends when its last sequence's forward does.
- Fairness: a forward that leaves s out takes at most max_batch_size - 1 later arrivals, so
  at most P(q) * (max_batch_size - 1) later sequences start before s.

K = 0 is strict FIFO (ceil((q + 1) / m) forwards); a large K is pure bucketing (q + 1).
tests/pooling/test_batcher_bound.py checks all three over random arrivals in virtual time.

Failure policy. A forward that raises TesseraError or ValueError refused its input (bad
input that slipped validation); the device is fine, so only that batch's requests fail (the
TesseraError's own status, else INTERNAL) and the batcher goes on. Anything else (a torch
RuntimeError, an executor that cannot run, a bug in this loop) leaves the device in an
unknown state: the batcher dies. `on_failure` runs first (the server reports NOT_SERVING
and stops its other batchers), then the running batch fails INTERNAL, every waiting
sequence UNAVAILABLE (it never ran, so another replica may take it), and new ones are
refused UNAVAILABLE at once. Restart the process.

Time is the event loop's clock (loop.time(), monotonic); tests run a virtual-time loop.
Each forward is also stamped with time.monotonic_ns() in the forward thread itself, so that a
caller's Span (submit's `span`) says when its rows were computed, not when the loop noticed.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from services.common.errors import Internal, Overloaded, TesseraError, Unavailable

from .metrics import PoolingMetrics

log = logging.getLogger("tessera.pooling.batcher")


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int      # sequences per forward
    max_batch_tokens: int    # padded tokens (B * longest) per forward
    max_wait_ms: float       # how long the oldest sequence may wait for company
    max_queue: int           # sequences waiting; beyond it requests are refused
    max_passes: int = 2      # forwards that may start without a sequence before it is overdue


@dataclass
class Span:
    """When one submit's sequences ran: time.monotonic_ns() read in the forward thread."""

    start_ns: int = 0        # the first forward holding one of them started
    end_ns: int = 0          # the last one ended
    batch_size: int = 0      # sequences in that last forward


@dataclass(eq=False)
class _Item:
    seq: object
    length: int
    arrived: float
    future: asyncio.Future = field(repr=False)
    passed: int = 0          # forwards started since it was queued, without it
    span: tuple[int, int, int] = (0, 0, 0)   # its forward's (start_ns, end_ns, batch size)


def select(items: list[_Item], limits: BatchLimits) -> list[_Item]:
    """The next batch from waiting items (arrival order): the overdue prefix in arrival
    order, then the sequences nearest the oldest in length, within max_batch_size and the
    padded-token budget. The oldest is always in it.

    Overdue items are a prefix of `items` (an older waiting item has been passed at least
    as often as a younger one). A single sequence always fits (the per-model length limit
    bounds it).
    """
    chosen, longest = [], 0
    for it in items:
        if it.passed < limits.max_passes or len(chosen) >= limits.max_batch_size:
            break
        width = max(longest, it.length)
        if chosen and width * (len(chosen) + 1) > limits.max_batch_tokens:
            break    # strictly in order: no overdue item overtakes another
        chosen.append(it)
        longest = width
    if not chosen:
        chosen, longest = [items[0]], items[0].length
    anchor, taken = items[0].length, set(chosen)
    ranked = sorted((it for it in items if it not in taken), key=lambda it: (abs(it.length - anchor), it.arrived))
    for it in ranked:
        if len(chosen) >= limits.max_batch_size:
            break
        width = max(longest, it.length)
        if width * (len(chosen) + 1) > limits.max_batch_tokens:
            continue
        chosen.append(it)
        longest = width
    return chosen


def _fail(items: Iterable[_Item], exc: Exception) -> None:
    for it in items:
        if not it.future.done():
            it.future.set_exception(exc)


class Batcher:
    """Batches sequences for one model. run(seqs) -> Tensor [B, ...] runs on `executor`
    (a one-thread pool shared by every model on the device). `on_failure(reason)` is awaited
    once, on the event loop, when the batcher dies (see the failure policy above)."""

    def __init__(self, name: str, run: Callable[[list], torch.Tensor], limits: BatchLimits,
                 executor: Executor, metrics: PoolingMetrics,
                 on_failure: Callable[[str], Awaitable[None]] | None = None):
        self.name, self.run, self.limits = name, run, limits
        self.executor, self.metrics, self.on_failure = executor, metrics, on_failure
        self.waiting: list[_Item] = []
        self.running: list[_Item] = []      # the batch in the forward now
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.closed = False
        self.failed: str | None = None      # why the batcher died, if it did

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def close(self) -> None:
        self.closed = True
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        _fail([*self.running, *self.waiting], Unavailable("the pooling service is shutting down"))
        self.running, self.waiting = [], []

    def fail(self, reason: str) -> None:
        """Stop for good because a forward on this device failed: refuse new sequences and
        answer every waiting or running one UNAVAILABLE."""
        if self.failed is None:
            self.failed = reason
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
        _fail([*self.running, *self.waiting], Unavailable(self._dead_message()))
        self.running, self.waiting = [], []
        self.metrics.queue_depth.labels(self.name).set(0)

    def _dead_message(self) -> str:
        return f"the pooling service stopped serving after a failed forward ({self.failed}); restart it"

    async def submit(self, seqs: list, span: Span | None = None) -> list[torch.Tensor]:
        """Queue seqs and wait for their result rows, in order; `span`, if given, is filled
        with when they ran. Overloaded when the queue cannot take them all (nothing is queued
        then); Unavailable once the batcher died."""
        if self.failed is not None:
            raise Unavailable(self._dead_message())
        if self.closed:
            raise Unavailable("the pooling service is shutting down")
        if len(self.waiting) + len(seqs) > self.limits.max_queue:
            raise Overloaded(f"pooling queue for {self.name} is full "
                             f"({len(self.waiting)} of {self.limits.max_queue} waiting); retry later")
        loop = asyncio.get_running_loop()
        now = loop.time()
        items = [_Item(s, len(s), now, loop.create_future()) for s in seqs]
        self.waiting.extend(items)
        self.metrics.queue_depth.labels(self.name).set(len(self.waiting))
        self.wakeup.set()
        try:
            rows = list(await asyncio.gather(*(it.future for it in items)))
        except asyncio.CancelledError:
            # A cancelled caller's sequences leave the queue rather than wasting a forward.
            gone = set(items)
            self.waiting = [it for it in self.waiting if it not in gone]
            raise
        if span is not None:
            last = max(items, key=lambda it: it.span[1])
            span.start_ns, span.end_ns, span.batch_size = min(it.span[0] for it in items), *last.span[1:]
        return rows

    async def _loop(self) -> None:
        try:
            while True:
                await self._wait_for_batch()
                batch = select(self.waiting, self.limits)
                taken = set(batch)
                self.waiting = [it for it in self.waiting if it not in taken]
                for it in self.waiting:
                    it.passed += 1
                self.metrics.queue_depth.labels(self.name).set(len(self.waiting))
                self.running = batch
                await self._forward(batch)
                self.running = []
        except Exception as exc:  # noqa: BLE001 - a dead worker must say so, never leave callers hanging
            log.exception("forward worker of %s failed", self.name)
            await self._die(f"{type(exc).__name__}: {exc}")

    async def _wait_for_batch(self) -> None:
        """Return when a full batch waits or the oldest item has waited max_wait_ms."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            if self._full():
                return
            left = self.waiting[0].arrived + self.limits.max_wait_ms / 1000 - loop.time()
            if left <= 0:
                return
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), left)
            except TimeoutError:
                return

    def _full(self) -> bool:
        if len(self.waiting) >= self.limits.max_batch_size:
            return True
        longest = max(it.length for it in self.waiting)
        return longest * len(self.waiting) >= self.limits.max_batch_tokens

    async def _forward(self, batch: list[_Item]) -> None:
        """Run one batch; a refused input fails the batch, anything else propagates (dies)."""
        seqs = [it.seq for it in batch]
        self.metrics.batch_size.labels(self.name).observe(len(batch))
        self.metrics.batch_tokens.labels(self.name).observe(sum(it.length for it in batch))
        loop = asyncio.get_running_loop()
        queue_wait, now = self.metrics.queue_seconds.labels(self.name), loop.time()
        for it in batch:
            queue_wait.observe(now - it.arrived)
        try:
            rows, start, end = await loop.run_in_executor(self.executor, self._timed, seqs)
        except (TesseraError, ValueError) as exc:
            log.exception("forward refused %d sequences of %s; failing that batch only", len(batch), self.name)
            _fail(batch, exc if isinstance(exc, TesseraError) else
                  Internal(f"the model could not run this batch: {exc}"))
            return
        if len(rows) != len(batch):
            raise RuntimeError(f"forward returned {len(rows)} rows for {len(batch)} sequences")
        self.metrics.forward_seconds.labels(self.name).observe((end - start) / 1e9)
        for i, it in enumerate(batch):
            it.span = (start, end, len(batch))
            if not it.future.done():
                it.future.set_result(rows[i])

    def _timed(self, seqs: list) -> tuple[object, int, int]:
        """run(seqs) in the forward thread, with its (start, end) time.monotonic_ns()."""
        start = time.monotonic_ns()
        rows = self.run(seqs)
        return rows, start, time.monotonic_ns()

    async def _die(self, reason: str) -> None:
        """Report first (health reads NOT_SERVING before any caller hears), then fail everyone."""
        self.failed = reason                    # new sequences are refused from here on
        batch, self.running = self.running, []  # kept from fail(), which on_failure calls
        log.error("%s: no longer serving: %s", self.name, reason)
        if self.on_failure is not None:
            try:
                await self.on_failure(reason)
            except Exception:  # noqa: BLE001 - the callers below must still hear
                log.exception("on_failure of %s raised", self.name)
        _fail(batch, Internal(f"the forward failed ({reason}); the pooling service stopped serving"))
        self.fail(reason)
