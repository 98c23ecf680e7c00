"""Dynamic batching: a bounded queue, a per-forward token budget, a maximum hold time,
length bucketing, and one forward at a time per device in a worker thread.

A request puts its sequences in the queue and awaits their rows. The dispatcher
always includes the oldest waiting sequence (so nothing starves), then adds the
waiting sequences closest to it in length while the padded size B * max_len stays
within the token budget, so padding stays small.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from services.common.errors import Overloaded, Unavailable

from .metrics import PoolingMetrics

log = logging.getLogger("tessera.pooling.batcher")


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int      # sequences per forward
    max_batch_tokens: int    # padded tokens (B * longest) per forward
    max_wait_ms: float       # how long the oldest sequence may wait for company
    max_queue: int           # sequences waiting; beyond it requests are refused


@dataclass(eq=False)
class _Item:
    seq: object
    length: int
    arrived: float
    future: asyncio.Future = field(repr=False)


def select(items: list[_Item], limits: BatchLimits) -> list[_Item]:
    """The next batch from waiting items (arrival order): the oldest plus its nearest
    neighbours in length, within max_batch_size and the padded-token budget.

    A single sequence always fits (the per-model length limit bounds it).
    """
    oldest = items[0]
    ranked = sorted(items[1:], key=lambda it: (abs(it.length - oldest.length), it.arrived))
    chosen, longest = [oldest], oldest.length
    for it in ranked:
        if len(chosen) >= limits.max_batch_size:
            break
        width = max(longest, it.length)
        if width * (len(chosen) + 1) > limits.max_batch_tokens:
            continue
        chosen.append(it)
        longest = width
    return chosen


class Batcher:
    """Batches sequences for one model. run(seqs) -> Tensor [B, ...] runs on `executor`
    (a one-thread pool shared by every model on the device)."""

    def __init__(self, name: str, run: Callable[[list], torch.Tensor], limits: BatchLimits,
                 executor: Executor, metrics: PoolingMetrics):
        self.name, self.run, self.limits = name, run, limits
        self.executor, self.metrics = executor, metrics
        self.waiting: list[_Item] = []
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.closed = False

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def close(self) -> None:
        self.closed = True
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        for it in self.waiting:
            if not it.future.done():
                it.future.set_exception(Unavailable("the pooling service is shutting down"))
        self.waiting.clear()

    async def submit(self, seqs: list) -> list[torch.Tensor]:
        """Queue seqs and wait for their result rows, in order. Overloaded when the queue
        cannot take them all (nothing is queued then)."""
        if self.closed:
            raise Unavailable("the pooling service is shutting down")
        if len(self.waiting) + len(seqs) > self.limits.max_queue:
            raise Overloaded(f"pooling queue for {self.name} is full "
                             f"({len(self.waiting)} of {self.limits.max_queue} waiting); retry later")
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        items = [_Item(s, len(s), now, loop.create_future()) for s in seqs]
        self.waiting.extend(items)
        self.metrics.queue_depth.labels(self.name).set(len(self.waiting))
        self.wakeup.set()
        try:
            return list(await asyncio.gather(*(it.future for it in items)))
        except asyncio.CancelledError:
            # A cancelled caller's sequences leave the queue rather than wasting a forward.
            gone = set(items)
            self.waiting = [it for it in self.waiting if it not in gone]
            raise

    async def _loop(self) -> None:
        while True:
            await self._wait_for_batch()
            batch = select(self.waiting, self.limits)
            taken = set(batch)
            self.waiting = [it for it in self.waiting if it not in taken]
            self.metrics.queue_depth.labels(self.name).set(len(self.waiting))
            await self._forward(batch)

    async def _wait_for_batch(self) -> None:
        """Return when a full batch waits or the oldest item has waited max_wait_ms."""
        while True:
            if not self.waiting:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            if self._full():
                return
            left = self.waiting[0].arrived + self.limits.max_wait_ms / 1000 - time.monotonic()
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
        seqs = [it.seq for it in batch]
        self.metrics.batch_size.labels(self.name).observe(len(batch))
        self.metrics.batch_tokens.labels(self.name).observe(sum(it.length for it in batch))
        try:
            rows = await asyncio.get_running_loop().run_in_executor(self.executor, self.run, seqs)
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its callers, not the loop
            log.exception("forward failed for %d sequences of %s", len(batch), self.name)
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(exc)
            return
        for i, it in enumerate(batch):
            if not it.future.done():
                it.future.set_result(rows[i])
