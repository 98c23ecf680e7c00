"""The heap bound (services/pooling/heap.py): a trim exactly when the resident size passes the last trim's
floor by the bound, with a fake resident size and trim; and glibc's real trim returning freed heap pages."""
from __future__ import annotations

import ctypes
import sys

import pytest

from services.pooling.heap import Heap, resident_bytes

MiB = 1 << 20


class FakeProcess:
    """A resident size that grows by what the test allocates and falls to `kept` on a trim."""

    def __init__(self, rss: int, kept: int):
        self.rss, self.kept, self.trimmed = rss, kept, 0

    def trim(self):
        self.rss, self.trimmed = self.kept, self.trimmed + 1


def test_trims_exactly_when_grown_past_the_bound_since_the_last_trim():
    proc = FakeProcess(rss=500 * MiB, kept=520 * MiB)
    heap = Heap(100 * MiB, resident=lambda: proc.rss, trim=proc.trim)
    assert heap.available and heap.floor == 500 * MiB
    proc.rss = 600 * MiB                    # at the bound: kept
    assert not heap.check() and proc.trimmed == 0
    proc.rss += 1                           # past it: trimmed, and the floor is what the trim left
    assert heap.check() and proc.trimmed == 1 and heap.floor == 520 * MiB
    proc.rss = 610 * MiB                    # within the new floor + bound
    assert not heap.check() and proc.trimmed == 1
    proc.rss = 621 * MiB
    assert heap.check() and heap.trims == 2


def test_a_real_leak_raises_the_floor_instead_of_trimming_forever():
    proc = FakeProcess(rss=100 * MiB, kept=100 * MiB)
    heap = Heap(10 * MiB, resident=lambda: proc.rss, trim=proc.trim)
    for step in range(1, 6):
        proc.kept = proc.rss = 100 * MiB + step * 11 * MiB   # live memory: the trim returns nothing
        assert heap.check()
        assert heap.floor == proc.kept
        assert not heap.check()             # one trim per bound's worth of growth, not one per forward


def test_zero_bound_never_trims():
    proc = FakeProcess(rss=1, kept=1)
    heap = Heap(0, resident=lambda: proc.rss, trim=proc.trim)
    proc.rss = 10**12
    assert not heap.check() and proc.trimmed == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or resident_bytes() is None, reason="glibc and /proc")
def test_glibc_trim_returns_the_pages_of_freed_heap_blocks():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 KiB blocks stay below the mmap threshold: heap memory. Touch them so they are resident.
    blocks = [libc.malloc(64 * 1024) for _ in range(1024)]
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    keep = blocks[-1]                        # holds the heap's top, so freeing the rest leaves a hole
    for b in blocks[:-1]:
        libc.free(b)
    heap = Heap(1, resident=resident_bytes)
    heap.floor = 0                            # as if it had grown past the bound
    before = resident_bytes()
    assert heap.check()
    assert before - resident_bytes() >= 32 * MiB   # most of the 64 MiB hole came back
    libc.free(keep)


def test_the_service_checks_its_heap_after_each_forward(monkeypatch, tiny_bert_dir):
    import grpc

    from services.common.pb import pooling_pb2, pooling_pb2_grpc
    from services.pooling import server as server_mod
    from tests.pooling.conftest import RunningServer

    checks = []

    class Recording(Heap):
        def check(self):
            checks.append(self.max_growth_bytes)
            return False
    monkeypatch.setattr(server_mod, "Heap", Recording)
    running = RunningServer(embedding_model=str(tiny_bert_dir), heap_growth_mb=3)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            for text in ("one", "two"):
                stub.Embed(pooling_pb2.EmbedRequest(inputs=[pooling_pb2.EmbedInput(text=text)]), timeout=30)
    finally:
        running.close()   # the forward thread has run every queued check once this returns
    assert checks == [3 * MiB, 3 * MiB]
