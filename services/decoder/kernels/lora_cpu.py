"""Multi-LoRA over the rows of a step on CPU, each row its own adapter in an arena: a C++ operator and its ref.

The kernel is lora_cpu.cpp next to this file (the loops are in lora_rows.h, which the decode stack shares),
compiled once per machine by native.load (`make kernels`). An arena is a pair A [P, K], Bt [P, N] holding the
rank rows of many adapters (an adapter of rank r at offset o owns rows [o, o + r) of both; Bt is B transposed,
with the LoRA scale folded in), so mixed ranks need no padding. `lora_rows` is the launcher, `lora_rows_ref`
the torch computation it must match.
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from services.common import native, plan

SOURCE = Path(__file__).with_suffix(".cpp")
BLOCK = 8             # rows on one adapter that share one read of its rows (lora_rows.h)
DTYPES = (torch.float32, torch.bfloat16)
# A call's least work per thread, in arena weights (lora_rows.h COARSE, FINE): below twice it the call runs on one
# thread. Which is faster depends on the CPU and the dtype; the adapter pool times both at load (lora/pool.py).
GRAINS = {"coarse": 1 << 16, "fine": 1 << 14}
# How a call's blocks ask for the rows they read next (lora_rows.h Ahead): paced, burst or not at all. Which is
# fastest depends on the CPU and the dtype (bursts took fp32 rows 12-17% longer than none on an Intel Xeon, family 6
# model 167, and bf16 rows 10-17% less); the adapter pool times them at load too.
PREFETCH = {"paced": 2, "burst": 1, "off": 0}
# time_reading: rows on distinct adapters of this rank, streamed from an arena of at least this many bytes, more
# than most caches hold (a step's adapter rows are): TIMING_ROWS for the grains (a few rows' work lies between
# them), PREFETCH_ROWS for the prefetch (a full step's blocks, where asking ahead shows).
TIMING_ROWS, PREFETCH_ROWS, TIMING_RANK, TIMING_BYTES = 4, 64, 16, 64 << 20
OPERATOR = native.Operator("lora_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def lora_rows(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, offsets: torch.Tensor,
              ranks: torch.Tensor, grain: int = GRAINS["coarse"], prefetch: int = PREFETCH["paced"]) -> torch.Tensor:
    """y += each row's LoRA correction, in place; returns y.

    y [M, N], x [M, K] (rows unit-strided, e.g. contiguous), A [P, K] and Bt [P, N] contiguous, all one dtype,
    float32 or bfloat16; offsets [M], ranks [M] int32 contiguous (rank 0: the row is left exactly as it was).

        for m: o, r = offsets[m], ranks[m]; if r: y[m] += (x[m] @ A[o:o+r].T) @ Bt[o:o+r]

    Sums in fp32 (bf16 on a CPU with avx512_bf16: its dot product, exact products, subnormals as zero); in
    bf16 rounded where the torch path stores (see lora_rows_ref). Rows with one (offset, rank), consecutive or
    not, share reads of their rows in blocks of BLOCK; the blocks run on the threads when there is at least twice
    `grain` work (GRAINS); prefetch: how each block asks for the rows it reads next (a value of PREFETCH). Each
    row's result is the same bit for bit whatever the other rows, the thread count, the grain and the prefetch.
    """
    load().lora_rows(y, x, A, Bt, offsets, ranks, grain, prefetch)
    return y


def last_level_cache(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of the CPU's largest cache, as sysfs lists them under `caches` (0 where it does not say)."""
    sizes = [0]
    for f in caches.glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = f.read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
    return max(sizes)


@functools.cache
def time_reading(width: int, dtype: torch.dtype, grain: int | None = None,
                 arena_bytes: int = TIMING_BYTES) -> dict[str, float]:
    """{candidate: seconds} of 32 lora_rows calls on a [width -> width] projection, each row on its own
    rank-TIMING_RANK adapter, every call on fresh arena rows (plan.fastest); once per process and shape. With grain
    None the candidates are GRAINS' (paced), at TIMING_ROWS rows a call; else PREFETCH's at that grain, at
    PREFETCH_ROWS rows a call. The arena holds about arena_bytes (at least two calls' rows per candidate), and each
    candidate starts at its own part of it, so that none reads rows another has just brought into the cache."""
    rows = TIMING_ROWS if grain is None else PREFETCH_ROWS
    candidates = ({name: (g, PREFETCH["paced"]) for name, g in GRAINS.items()} if grain is None
                  else {name: (grain, on) for name, on in PREFETCH.items()})
    span = rows * TIMING_RANK
    P = max(2 * len(candidates) * span, arena_bytes // (2 * width * dtype.itemsize) // span * span)
    A = torch.empty(P, width, dtype=dtype).fill_(0.25)   # the values do not change the time: the reads do
    Bt = torch.empty(P, width, dtype=dtype).fill_(-0.25)
    x, y = torch.full((rows, width), 0.5, dtype=dtype), torch.zeros(rows, width, dtype=dtype)
    ranks = torch.full((rows,), TIMING_RANK, dtype=torch.int32)
    steps = torch.arange(0, P, TIMING_RANK, dtype=torch.int32).view(-1, rows)   # [P / span, rows] offsets
    cursor = {name: i * len(steps) // len(candidates) for i, name in enumerate(candidates)}

    def call(name: str) -> None:
        for _ in range(32):
            lora_rows(y, x, A, Bt, steps[cursor[name]], ranks, *candidates[name])
            cursor[name] = (cursor[name] + 1) % len(steps)
    return plan.fastest({name: (lambda name=name: call(name)) for name in candidates})


def lora_rows_torch(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, offsets: torch.Tensor,
                    ranks: torch.Tensor) -> torch.Tensor:
    """lora_rows in torch, in place (the adapter pool's path where the operator cannot be built): rows that share
    (offset, rank) are gathered and run as two matmuls, rounded as lora_rows_ref. Returns y."""
    live = torch.nonzero(ranks > 0).flatten()
    if not live.numel():
        return y
    keys = torch.stack([offsets[live].to(torch.int64), ranks[live].to(torch.int64)], dim=1)
    groups, inverse = torch.unique(keys, dim=0, return_inverse=True)
    for g, (o, r) in enumerate(groups.tolist()):
        rows = live[inverse == g]
        h = (x.index_select(0, rows).float() @ A[o:o + r].float().t()).to(y.dtype)
        delta = (h.float() @ Bt[o:o + r].float()).to(y.dtype)
        y[rows] = (y.index_select(0, rows).float() + delta.float()).to(y.dtype)
    return y


def lora_rows_ref(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, offsets: torch.Tensor,
                  ranks: torch.Tensor) -> torch.Tensor:
    """The torch reference, out of place: a new tensor of y's shape and dtype. Per row with rank r > 0, as two
    torch matmuls in the arena's dtype would: h = (x[m] @ A[o:o+r].T) rounded to the dtype, delta = (h @
    Bt[o:o+r]) rounded, y[m] + delta rounded; fp32 sums throughout."""
    out = y.clone()
    dtype = y.dtype
    for m, (o, r) in enumerate(zip(offsets.tolist(), ranks.tolist(), strict=True)):
        if r:
            h = (x[m].float() @ A[o:o + r].float().T).to(dtype)
            delta = (h.float() @ Bt[o:o + r].float()).to(dtype)
            out[m] = (y[m].float() + delta.float()).to(dtype)
    return out


if __name__ == "__main__":
    OPERATOR.main()
