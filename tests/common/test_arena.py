"""services/common/arena.py: tensors in one mapping of 2 MiB pages, copied exactly, zeroed, or left to
torch when huge pages are off (--fast-paths huge_pages=off)."""
from __future__ import annotations

import errno
import mmap

import pytest
import torch

from services.common import arena


def test_place_copies_every_tensor_exactly_aligned(monkeypatch):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).to(torch.bfloat16),
               torch.randint(-128, 127, (2, 9), generator=g, dtype=torch.int8), torch.randn(33, 4, generator=g)]
    held, placed, summary = arena.place(tensors)
    assert held is not None and summary.startswith("one arena of ")
    assert placed[0].data_ptr() % arena.HUGE == 0
    for t, p in zip(tensors, placed, strict=True):
        assert p.dtype == t.dtype and p.shape == t.shape and torch.equal(p, t)
        assert p.data_ptr() % arena.ALIGN == 0 and p.data_ptr() != t.data_ptr()
        assert held.address <= p.data_ptr() < held.address + held.size


def test_zeros_are_zero_and_writable(monkeypatch):
    held, (k, v), _ = arena.zeros([((4, 2, 3), torch.bfloat16), ((4, 2, 3), torch.bfloat16)])
    assert held is not None and not k.any() and not v.any()
    k[1] = 2.5
    assert float(k.sum()) == 15.0 and not v.any()     # disjoint


@pytest.mark.skipif(arena.thp_setting() not in ("always", "madvise"),
                    reason="this kernel gives no transparent huge pages to a madvised mapping")
def test_a_large_arena_gets_huge_pages(monkeypatch):
    """What the kernel granted, read back from /proc/self/smaps: the point of the arena."""
    held, (t,), summary = arena.place([torch.ones(4 << 20)])      # 16 MiB of fp32
    assert held.huge_bytes() >= 8 << 20, summary
    assert "MiB in 2 MiB pages (" in summary


def test_a_kernel_without_huge_pages_still_gets_an_arena(monkeypatch):
    """madvise(MADV_HUGEPAGE) fails with EINVAL on a kernel built without THP: plain pages, said so."""

    class NoAdvice(mmap.mmap):
        def madvise(self, *args):
            raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(arena.mmap, "mmap", NoAdvice)
    t = torch.arange(10.0)
    held, (placed,), summary = arena.place([t])
    assert torch.equal(placed, t) and held.refused
    assert "4 KiB pages (madvise(MADV_HUGEPAGE) refused: Invalid argument)" in summary


def test_off_leaves_torch_allocations():
    t = torch.ones(3)
    held, placed, summary = arena.place([t], huge_pages=False)
    assert held is None and placed[0] is t and "huge pages off" in summary
    held, (z,), _ = arena.zeros([((2, 2), torch.float32)], huge_pages=False)
    assert held is None and not z.any()
