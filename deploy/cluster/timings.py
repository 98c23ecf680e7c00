"""Seconds per phase of `up`, printed as each ends and kept in build/cluster/timings.json (the last run's)."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .commands import log
from .paths import TIMINGS


class Timings:
    def __init__(self) -> None:
        # phase -> seconds; "healthy after start, per service" -> {service: seconds}
        self.phases: dict[str, float | dict[str, float]] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            # A phase that failed is timed too: the line says how long it ran before it did.
            took = time.monotonic() - started
            self.phases[name] = round(took, 1)
            log(f"== {name}: {took:.1f}s")

    def save(self, engine: str) -> None:
        TIMINGS.parent.mkdir(parents=True, exist_ok=True)
        TIMINGS.write_text(json.dumps({"engine": engine, "phases": self.phases}, indent=1) + "\n")
