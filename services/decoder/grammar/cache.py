"""A bounded, thread-safe LRU of compile futures: one compile per key however many requests ask at once."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future


class FutureCache:
    """key -> Future, at most `size` keys, least recently used evicted first.

    get_or_start(key, start) returns the cached future (a hit, finished or still running) or the one
    start() returns (a miss). A future that fails is dropped when it fails, so an error is never
    served from the cache: a bad input is rejected again on its own merits, and entries hold only
    compiled results.
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"cache size must be at least 1, got {size}")
        self.size = size
        self._entries: OrderedDict[Hashable, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_start(self, key: Hashable, start: Callable[[], Future]) -> tuple[Future, bool]:
        """(future, hit)."""
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return future, True
            future = start()
            self._entries[key] = future
            self.misses += 1
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        future.add_done_callback(lambda f: (f.cancelled() or f.exception() is not None) and self._drop(key, f))
        return future, False

    def _drop(self, key: Hashable, future: Future) -> None:
        with self._lock:
            if self._entries.get(key) is future:
                del self._entries[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
