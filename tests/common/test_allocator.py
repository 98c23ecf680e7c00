"""services/common/allocator.py: glibc keeps the pages a forward frees, unless its mode is "default"
(--fast-paths malloc=default)."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from services.common import allocator

# A child process frees a touched 24 MiB block (the size of a prefill chunk's gate|up output) and prints
# how many MiB its resident size dropped by. The settings are process-wide, so they are tried in children.
CHILD = textwrap.dedent("""
    import ctypes, sys
    from services.common import allocator
    from services.pooling.heap import resident_bytes
    allocator.keep_freed_memory(sys.argv[1])
    libc = allocator.libc()
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 24 << 20
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    before = resident_bytes()
    libc.free(block)
    print((before - resident_bytes()) >> 20)
""")


def _dropped_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not hasattr(allocator.libc(), "mallopt"),
                    reason="the thresholds are set through glibc's mallopt; this C library has none")
def test_freed_block_stays_resident_only_when_kept():
    assert _dropped_mib("default") >= 20      # glibc maps a 24 MiB block on its own and unmaps it on free
    assert _dropped_mib("keep") <= 1          # kept: the next forward touches no new page


class FakeLibc:
    """mallopt records its calls; a plain function, so that ctypes' restype/argtypes can be set on it."""

    def __init__(self, answer: int = 1):
        self.calls = []

        def mallopt(param, value):
            self.calls.append((param, value))
            return answer
        self.mallopt = mallopt


def test_keep_sets_both_thresholds(monkeypatch, caplog):
    fake = FakeLibc()
    monkeypatch.setattr(allocator, "libc", lambda: fake)
    with caplog.at_level(logging.INFO, "tessera.allocator"):
        summary = allocator.keep_freed_memory()
    # The mmap threshold first: fixing the trim threshold alone stops the mmap threshold's growth (slower).
    assert fake.calls == [(allocator.M_MMAP_THRESHOLD, 32 << 20), (allocator.M_TRIM_THRESHOLD, 1 << 30)]
    assert summary.startswith("freed memory kept") and summary in caplog.text


def test_default_mode_leaves_malloc_alone(monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(allocator, "libc", lambda: fake)
    assert "defaults" in allocator.keep_freed_memory(" Default ")
    assert fake.calls == []


def test_refusal_and_missing_glibc_are_said(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "libc", lambda: FakeLibc(answer=0))
    with caplog.at_level(logging.WARNING, "tessera.allocator"):
        assert "refused" in allocator.keep_freed_memory("keep")
    assert "refused" in caplog.text
    monkeypatch.setattr(allocator, "libc", lambda: None)
    assert "no glibc" in allocator.keep_freed_memory("keep")


def test_bad_mode_names_the_value():
    with pytest.raises(ValueError, match="malloc mode 'jemalloc': expected one of keep, default"):
        allocator.keep_freed_memory("jemalloc")


def test_the_pin_reaches_malloc_at_start(monkeypatch):
    """services/common/process.py applies the service's `malloc` pin; auto (the default) is keep."""
    from services.common.plan import Pins
    fake = FakeLibc()
    monkeypatch.setattr(allocator, "libc", lambda: fake)
    assert "defaults" in allocator.keep_freed_memory(Pins.parse("malloc=default").get("malloc")) and not fake.calls
    assert allocator.keep_freed_memory(Pins.parse("").get("malloc")).startswith("freed memory kept")
