"""Tensors carved out of one anonymous mapping that the kernel backs with 2 MiB pages where it allows.

Why: a decode step of a few rows streams every weight once (SmolLM2-135M: 270 MB in bf16) and is
bound by memory. In 4 KiB pages the weights alone are ~66,000 pages a token, each a TLB miss and a
page walk beside the stream. Where transparent huge pages are "madvise" (Debian's default, and this
project's machines: what torch and safetensors allocate gets 4 KiB pages), a mapping marked
MADV_HUGEPAGE gets 2 MiB pages as it is first touched. Measured on an AMD EPYC Zen 4 (2 cores),
SmolLM2's batch-1 decode step (the stack and the LM head) with its weights in one arena against where
they were loaded, medians of 15 alternating rounds: bf16 7.11 vs 7.82 and 7.87 vs 9.70 ms, int8 5.36
vs 5.88 ms, fp32 17.26 vs 17.68 ms. The KV cache is allocated the same way: a long context's attention
reads blocks scattered over it, and its pages are committed only as they are written (torch.zeros
wrote all of it at start); a 64-row step at 320 keys, compute-bound, ran the same either way.

`place(tensors)` copies tensors into one arena and returns its views in the same order (the caller
swaps them in; parameters by `.data`, so tied weights stay tied). `zeros(specs)` gives zero tensors
(the kernel's zero pages, touched only as they are written). Each summary says how much the kernel
actually backed with huge pages (/proc/self/smaps): "never", fragmented memory or a kernel without
THP quietly give 4 KiB pages. huge_pages=False (--fast-paths huge_pages=off, services/common/plan.py)
keeps torch's own allocations (A/B benchmarks).
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from pathlib import Path

import torch

HUGE = 2 << 20        # the x86-64 transparent huge page
ALIGN = 64            # each tensor starts on a cache line (the kernels' vector loads)
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

Spec = tuple[Sequence[int], torch.dtype]


class Arena:
    """One private anonymous mapping holding zeroed tensors of the given shapes and dtypes, each on a
    cache line, the first on a 2 MiB boundary; keep it alive as long as its tensors."""

    def __init__(self, specs: Sequence[Spec]):
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
        offsets, self.size = [], 0
        for n in sizes:
            offsets.append(self.size)
            self.size += -(-n // ALIGN) * ALIGN
        # One huge page more than needed, to start at the first 2 MiB boundary inside: then every whole
        # 2 MiB of the arena can be one page.
        self.map = mmap.mmap(-1, self.size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Why there are no huge pages to ask for, if there are none: a kernel built without THP refuses
        # the advice (EINVAL), and the arena is then plain memory that still works.
        self.refused = "" if hasattr(mmap, "MADV_HUGEPAGE") else "no MADV_HUGEPAGE on this platform"
        if not self.refused:
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
            except OSError as exc:
                self.refused = f"madvise(MADV_HUGEPAGE) refused: {exc.strerror}"
        raw = torch.frombuffer(self.map, dtype=torch.uint8)
        start = -raw.data_ptr() % HUGE
        self.address = raw.data_ptr() + start
        self.tensors = [raw[start + off:start + off + n].view(dtype).view(*shape)
                        for (shape, dtype), off, n in zip(specs, offsets, sizes, strict=True)]

    def huge_bytes(self) -> int | None:
        """Bytes of the arena in huge pages now (its mapping's AnonHugePages), None if unreadable."""
        try:
            lines = Path("/proc/self/smaps").read_text().splitlines()
        except OSError:
            return None
        inside = False
        for line in lines:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):       # a mapping's first line: "lo-hi perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= self.address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
        return None

    def summary(self, written: bool = True) -> str:
        """What the log says: the size and, once written, how much of it the kernel gave huge pages."""
        huge = self.huge_bytes()
        got = (f"4 KiB pages ({self.refused})" if self.refused else
               "2 MiB pages as it is first written" if not written else
               "huge pages unreadable" if huge is None else f"{huge / (1 << 20):.0f} MiB in 2 MiB pages")
        return f"one arena of {self.size / (1 << 20):.0f} MiB, {got} (transparent_hugepage={thp_setting()})"


def thp_setting() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or "unknown"."""
    try:
        words = THP.read_text().split()
    except OSError:
        return "unknown"
    return next((w[1:-1] for w in words if w.startswith("[")), "unknown")


def _refused(devices: Sequence[torch.device], huge_pages: bool) -> str:
    """Why tensors on these devices stay in torch's allocations, or "" when they go to an arena."""
    if not huge_pages:
        return "torch's allocations (huge pages off)"
    if any(d.type != "cpu" for d in devices):
        return "torch's allocations (not on CPU)"
    return ""


def place(tensors: Sequence[torch.Tensor], huge_pages: bool = True) -> tuple[Arena | None, list[torch.Tensor], str]:
    """(the arena or None, copies of tensors in it in the same order, a summary); the tensors as they
    are when huge_pages is False or any is not on CPU."""
    tensors = list(tensors)
    refused = _refused([t.device for t in tensors], huge_pages)
    if refused or not tensors:
        return None, tensors, refused or "nothing to place"
    arena = Arena([(t.shape, t.dtype) for t in tensors])
    for view, t in zip(arena.tensors, tensors, strict=True):
        view.copy_(t)     # the first write of each 2 MiB faults it in, as a huge page where it can
    return arena, arena.tensors, arena.summary()


def zeros(specs: Sequence[Spec], device: torch.device | str = "cpu",
          huge_pages: bool = True) -> tuple[Arena | None, list[torch.Tensor], str]:
    """(the arena or None, zero tensors of specs, a summary); torch.zeros when huge_pages is False or
    the device is not the CPU."""
    refused = _refused([torch.device(device)], huge_pages)
    if refused or not specs:
        return None, [torch.zeros(tuple(s), dtype=d, device=device) for s, d in specs], refused or "nothing to place"
    arena = Arena(specs)
    return arena, arena.tensors, arena.summary(written=False)
