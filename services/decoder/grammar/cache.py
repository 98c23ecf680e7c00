"""A thread-safe LRU of compile futures, bounded by entries and by bytes: one compile per key however many
requests ask at once."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass
class _Entry:
    future: Future
    nbytes: int = 0          # the result's weight once it is done; 0 while compiling
    pinned: bool = False     # never evicted (a built-in every replica needs at once, e.g. json_object)


class FutureCache:
    """key -> Future, at most `size` keys and `max_bytes` bytes of results (weigh(result) each), least
    recently used evicted first.

    get_or_start(key, start) returns the cached future (a hit, finished or still running) or the one
    start() returns (a miss). A future that fails is dropped when it fails, so an error is never
    served from the cache: a bad input is rejected again on its own merits, and entries hold only
    compiled results. A result is weighed when it is done; one heavier than max_bytes alone is handed
    to its waiters and not kept. Evicting a running compile's entry only forgets it: its waiters still
    get its result.
    """

    def __init__(self, size: int, max_bytes: int | None = None, weigh: Callable[[object], int] = lambda _: 0):
        if size < 1:
            raise ValueError(f"cache size must be at least 1, got {size}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"cache bytes must be at least 1, got {max_bytes}")
        self.size = size
        self.max_bytes = max_bytes
        self._weigh = weigh
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get_or_start(self, key: Hashable, start: Callable[[], Future], *, pin: bool = False) -> tuple[Future, bool]:
        """(future, hit). pin: the entry is never evicted (it still counts toward the bounds)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry.future, True
            future = start()
            self._entries[key] = _Entry(future, pinned=pin)
            self.misses += 1
            self._evict()
        future.add_done_callback(lambda f: self._done(key, f))
        return future, False

    def _done(self, key: Hashable, future: Future) -> None:
        failed = future.cancelled() or future.exception() is not None
        nbytes = 0 if failed else max(0, int(self._weigh(future.result())))
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.future is not future:
                return
            if failed or (self.max_bytes is not None and nbytes > self.max_bytes and not entry.pinned):
                del self._entries[key]
                self.evictions += not failed
                return
            entry.nbytes = nbytes
            self._bytes += nbytes
            self._evict()

    def _evict(self) -> None:
        # Under the lock: least recently used first, pinned entries skipped.
        def over() -> bool:
            return len(self._entries) > self.size or (self.max_bytes is not None and self._bytes > self.max_bytes)
        for key in [k for k, e in self._entries.items() if not e.pinned]:
            if not over():
                return
            self._bytes -= self._entries.pop(key).nbytes
            self.evictions += 1

    @property
    def nbytes(self) -> int:
        """Bytes of the results kept (finished compiles)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
