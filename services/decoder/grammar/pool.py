"""Compile threads with a deadline: a compile that runs past it fails at once, and its thread is replaced.

    pool = CompilePool(threads=2, deadline_s=10.0, on_overdue=lambda job: ..., initializer=...)
    future = pool.submit(fn, *args)  # fn's result, or the error on_overdue(job) returns at the deadline
    future.started                   # monotonic time fn began, None while queued
    pool.close()

Why threads that are written off, not processes that are killed: xgrammar compiles in C++ and cannot be
interrupted, so only a process could stop a runaway compile. A compile process would have to import
xgrammar (and with it torch, some 300 MB each), rebuild the tokenizer's xgrammar vocabulary (0.2 s for
SmolLM2's 49k tokens, seconds for 150k), and send every compiled grammar back serialized (its token-mask
cache, megabytes for a long pattern) to be deserialized on the server. Instead a compile past the deadline
is written off: its future fails with on_overdue's error at once (the request is answered, and the
compiler remembers the spec so a repeat is refused without compiling), the thread runs on to the end and
then exits, and a fresh thread takes its place so the compiles queued behind it are not held up. At most
`max_overdue` written-off threads run at once: past that no replacement starts, so crafted inputs can
take at most threads + max_overdue cores, and what waits behind them is bounded by the caller's own wait
(the server answers RESOURCE_EXHAUSTED, 429, when a compile has not started within the deadline).

Threads are daemons, but a process must not exit while one is inside xgrammar's C++: its static
destructors then run under the live thread and the C++ runtime aborts ("terminate called without an
active exception", status -6). So `join` waits for the compiles running at close, up to a bound, and says
whether any are left; the server exits without running destructors only when a written-off compile is
still going (services/decoder/server/service.py).
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field


class JobFuture(Future):
    """A Future that says when its call began: started, a time.monotonic(), None while queued."""

    started: float | None = None


@dataclass(eq=False)
class Job:
    """One submitted call."""

    fn: Callable
    args: tuple
    future: JobFuture = field(default_factory=JobFuture)
    overdue: bool = False


class CompilePool:
    """threads: compiles at once within the deadline; max_overdue: written-off threads still running at
    most (default: threads); on_overdue(job) -> the exception the job's future fails with."""

    def __init__(self, threads: int, deadline_s: float, on_overdue: Callable[[Job], BaseException], *,
                 max_overdue: int | None = None, initializer: Callable[[], None] | None = None,
                 name: str = "grammar"):
        if threads < 1 or not deadline_s > 0:
            raise ValueError(f"need threads >= 1 and a positive deadline, got {threads}, {deadline_s}")
        self.threads = threads
        self.deadline_s = deadline_s
        self.max_overdue = threads if max_overdue is None else max_overdue
        self._on_overdue = on_overdue
        self._initializer = initializer
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._running: list[tuple[float, int, Job]] = []     # heap of (deadline, seq, job) being compiled
        self._seq = itertools.count()
        self._workers = 0          # threads that take jobs (written-off ones excluded)
        self._idle = 0
        self._overdue = 0          # written-off threads still compiling
        self._owed = 0             # replacements not started because max_overdue was reached
        self._closed = False
        self.written_off = 0       # jobs failed at the deadline, so far
        threading.Thread(target=self._watch, name=f"{name}-deadline", daemon=True).start()

    # -- callers ------------------------------------------------------------------------------

    def submit(self, fn: Callable, *args) -> JobFuture:
        job = Job(fn, args)
        with self._cond:
            if self._closed:
                raise RuntimeError("the compile pool is closed")
            self._queue.append(job)
            # Owed replacements count as workers: the overdue bound holds however many calls arrive.
            if self._idle == 0 and self._workers + self._owed < self.threads:
                self._spawn()
            self._cond.notify_all()
        return job.future

    @property
    def overdue(self) -> int:
        """Written-off threads still running."""
        with self._cond:
            return self._overdue

    def join(self, timeout: float) -> bool:
        """Wait up to timeout seconds for every running compile (written-off ones included) to return;
        whether none is left. Call after close."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._running or self._overdue:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Queued jobs are cancelled; running ones finish on their (daemon) threads (see join)."""
        with self._cond:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            self._cond.notify_all()
        for job in queued:
            job.future.cancel()

    # -- threads ------------------------------------------------------------------------------

    def _spawn(self) -> None:
        # Under the lock.
        self._workers += 1
        threading.Thread(target=self._work, name=f"{self._name}-{next(self._seq)}", daemon=True).start()

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            with self._cond:
                self._idle += 1
                while not self._queue and not self._closed:
                    self._cond.wait()
                self._idle -= 1
                if self._closed:
                    self._workers -= 1
                    return
                job = self._queue.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue
                job.future.started = time.monotonic()
                heapq.heappush(self._running, (job.future.started + self.deadline_s, next(self._seq), job))
                self._cond.notify_all()          # the watchdog's next deadline may be this one
            try:
                result, error = job.fn(*job.args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the future, as an executor does
                result, error = None, exc
            with self._cond:
                overdue = job.overdue
                if not overdue:
                    self._running = [r for r in self._running if r[2] is not job]
                    heapq.heapify(self._running)
                    self._cond.notify_all()      # join may be waiting for it
            if not overdue:
                try:
                    job.future.set_exception(error) if error is not None else job.future.set_result(result)
                except InvalidStateError:
                    pass
                continue
            with self._cond:
                # Written off: this thread's place was given to a replacement (or is owed one).
                self._overdue -= 1
                if self._owed and not self._closed:
                    self._owed -= 1
                    self._spawn()
                self._cond.notify_all()
            return

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._closed and not self._running:
                    return
                now = time.monotonic()
                due = []
                while self._running and self._running[0][0] <= now:
                    due.append(heapq.heappop(self._running)[2])
                for job in due:
                    job.overdue = True
                    self.written_off += 1
                    self._workers -= 1
                    self._overdue += 1
                    if self._overdue <= self.max_overdue and not self._closed:
                        self._spawn()
                    else:
                        self._owed += 1
                if not due:
                    self._cond.wait(self._running[0][0] - now if self._running else None)
            for job in due:
                try:
                    job.future.set_exception(self._on_overdue(job))
                except InvalidStateError:
                    pass
