"""The fastest of a few calls: the clock behind every load-time choice made by timing."""
from __future__ import annotations

import time
from collections.abc import Callable


def fastest(fn: Callable[[], object], reps: int) -> float:
    """Seconds of the fastest of `reps` calls of fn, after one warm-up call."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)
