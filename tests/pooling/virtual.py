"""Virtual time for batcher tests: an event loop whose clock jumps to the next timer instead of
sleeping, and a simulated device whose forwards take a fixed virtual time.

Nothing sleeps, so a test over thousands of virtual milliseconds runs in milliseconds and
reads the same on a loaded machine as on an idle one.
"""
from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from concurrent.futures import Executor, Future


class _JumpingSelector(selectors.DefaultSelector):
    """Poll without blocking; with nothing ready, move the loop's clock to the next timer."""

    loop: VirtualLoop

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("virtual-time loop would wait forever: nothing is scheduled (a hang)")
        self.loop.now += timeout
        return ready


class VirtualLoop(asyncio.SelectorEventLoop):
    """loop.time() is virtual seconds from 0; asyncio.sleep and wait_for timeouts use it."""

    def __init__(self):
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


class SimulatedDevice(Executor):
    """An Executor for Batcher: fn(*args) runs at once on the loop thread, and its future
    completes `seconds` virtual seconds later. One forward at a time, like the real
    one-thread pool (the batcher never submits a second before the first ends)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float):
        self.loop, self.seconds = loop, seconds
        self.busy_until = float("-inf")

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        now = self.loop.time()
        if now < self.busy_until - 1e-9:   # the clock jumps by float sums: allow their rounding
            raise AssertionError("a second forward started while one was running")
        self.busy_until = now + self.seconds
        future: Future = Future()
        future.set_running_or_notify_cancel()   # running from now on, as in a thread pool: not cancellable
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - delivered through the future, like a thread pool
            self.loop.call_later(self.seconds, future.set_exception, exc)
        else:
            self.loop.call_later(self.seconds, future.set_result, result)
        return future


def run_virtual(main: Callable[[asyncio.AbstractEventLoop], object]):
    """Run the coroutine main(loop) on a fresh VirtualLoop and return its result."""
    with asyncio.Runner(loop_factory=VirtualLoop) as runner:
        loop = runner.get_loop()
        return runner.run(main(loop))
