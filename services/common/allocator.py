"""glibc malloc set to keep the pages a forward frees for the next forward (--fast-paths malloc=keep).

Why: a forward's activations are large and short-lived (a 2,048-token prefill chunk's gate|up output
is 2,048 x 3,072 fp32, 24 MiB; a pooling batch's FFN input 1,654 x 1,536) and each lives for one op.
By default glibc serves a block above its mmap threshold with a fresh mapping, and hands the heap's
free top back to the kernel once it passes the trim threshold; both thresholds follow the largest
block freed so far. Either way freed pages go back, and the next forward pays a page fault and a
zeroed page for every 4 KiB it touches again. Fixing the mmap threshold at glibc's 32 MiB ceiling
and the trim threshold at 1 GiB keeps them (glibc.malloc.* tunables, set with mallopt at start).
Either setting alone is slower than the defaults: a fixed trim threshold also stops the mmap
threshold from rising. On an AMD EPYC Zen 4 (2 cores) a 2,048-token SmolLM2 prefill chunk took ~2.6
instead of 3.0-3.9 s in fp32 (~360,000 page faults -> under 15,000), and in a fresh process the MiniLM
forward of 52 sentences ~200 instead of ~250 ms (a pooling service under steady load had mostly stopped
faulting by itself: its thresholds had risen).

Memory: the process keeps its peak heap instead of returning it between forwards. The pooling
service still returns fragmented free pages whenever its resident size has grown by a bound
(services/pooling/heap.py). Mode "default" (--fast-paths malloc=default) keeps glibc's own behaviour; without glibc
(musl, macOS) nothing is set and the log says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("tessera.allocator")

MODES = ("keep", "default")
# mallopt parameters (malloc.h) and values: glibc refuses an mmap threshold above 32 MiB on 64-bit.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 1 << 30


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory(mode: str = "keep") -> str:
    """Apply mode (keep, or default; "auto" is keep: this choice is not timed) to this process's malloc;
    returns the log line's summary. ValueError names a bad mode. Call it once at start, before the model
    loads."""
    mode = (mode or "keep").strip().lower()
    mode = "keep" if mode == "auto" else mode
    if mode not in MODES:
        raise ValueError(f"malloc mode {mode!r}: expected one of {', '.join(MODES)}")
    mallopt = getattr(libc(), "mallopt", None)
    level = logging.INFO
    if mode == "default":
        summary = "glibc defaults (malloc=default)"
    elif mallopt is None:
        summary = "the C library's defaults (no glibc mallopt here)"
    else:
        mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
        # mallopt returns 1 on success.
        if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1:
            summary = "freed memory kept (mmap threshold 32 MiB, trim threshold 1 GiB)"
        else:
            level, summary = logging.WARNING, "glibc refused the thresholds"
    log.log(level, "malloc: %s", summary)
    return summary
