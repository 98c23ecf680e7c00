"""The C heap's growth, bounded: glibc's malloc_trim whenever the resident size has grown by a bound since
the last trim.

Why: a forward allocates activations whose sizes follow each batch's shape (tokens x hidden, padded
rows x 3 x hidden for attention, ...), from a few hundred KiB to tens of MiB. glibc raises its mmap
threshold to the largest block freed so far (up to 32 MiB), so after the first large forward such blocks
come from the heap instead of mmap, and blocks of ever-changing sizes leave free holes whose pages the
heap keeps. Under a steady embedding load the pooling service's RSS grew by ~80 MiB a minute that way
(docs/benchmarks.md, the soak). malloc_trim(0) hands the free holes' pages back to the system.

The bound: right after a trim the resident size is the floor; the next trim comes once it is
`max_growth_bytes` above the floor, so between trims the heap keeps at most that much more than it
did. Memory that is really in use raises the floor (the trim cannot return it), so a true leak still
shows as a rising floor. Reading the resident size is one small /proc read per forward; a trim walks
the arenas (a few ms), and comes only once per `max_growth_bytes` of growth.

Where there is no glibc or no /proc (musl, macOS) nothing is bounded and `Heap.available` is False.
"""
from __future__ import annotations

import ctypes
import logging
import os

from services.common.allocator import libc

log = logging.getLogger("tessera.pooling.heap")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident set size (Linux /proc), or None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def _malloc_trim():
    """glibc's malloc_trim(0) as a callable, or None where the C library lacks it."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is None:
        return None
    trim.restype, trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
    return lambda: trim(0)


class Heap:
    """`check()` trims once the resident size is max_growth_bytes above the last trim's (0: never).

    `resident` and `trim` default to /proc and glibc; tests pass fakes."""

    def __init__(self, max_growth_bytes: int, resident=None, trim=None):
        self.max_growth_bytes = max_growth_bytes
        self.resident = resident or resident_bytes
        self._trim = trim or _malloc_trim()
        floor = self.resident() if self._trim is not None else None
        self.available = floor is not None
        self.floor = floor or 0
        self.trims = 0

    def check(self) -> bool:
        """Trim if grown past the bound; True when it trimmed. Call it between forwards, in the forward thread."""
        if not (self.available and self.max_growth_bytes):
            return False
        if self.resident() <= self.floor + self.max_growth_bytes:
            return False
        grown = self.resident()
        self._trim()
        self.floor = self.resident()
        self.trims += 1
        log.debug("heap trim %d: resident %d -> %d MiB", self.trims, grown >> 20, self.floor >> 20)
        return True
