"""Few-row (decode) matmul on CPU that streams each weight row once: a C++ operator and its torch ref.

The kernel is gemv_cpu.cpp next to this file, compiled once per machine by native.load (`make
kernels`). `gemv` is the launcher, `gemv_ref` the torch computation it must match. Whether it
beats the library matmul at a given shape and row count is measured at load
(services/decoder/model/matmul_choice.py); this module only computes.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from services.common import native

SOURCE = Path(__file__).with_suffix(".cpp")
# Rows of x per call: PASS_ROWS in registers, the rest over each weight row again from L1 (common/kernels/vec.h).
PASS_ROWS = 4
MAX_ROWS = 2 * PASS_ROWS
QBLOCK = 32           # over int8 weights, x is rounded to int8 in blocks of this many inputs
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
# The loops for bf16 x over bf16 weights (gemv_bf16.h), in the order of its Bf16Row values: one weight row
# at a time against every row of x, or one row of x against four weight rows at a time. Same sums up to
# their order; which streams faster depends on the CPU (model/matmul_choice.py times them at load).
BF16_ROWS = ("rowwise", "interleave4")
# How far ahead of the row they read the few-row kernels ask for the weight (`prefetch`; the grouped kernel's too): 8
# KiB, the best of 2-16 KiB on a chain of 3072 x 576 fp32 weights from memory on an Intel Xeon (common/kernels/vec.h,
# prefetch_ahead).
PREFETCH_BYTES = 8 << 10
# The order the few-row kernels (the grouped one's too) read each thread's weight rows in, by the gemv_streams path's
# value: front to back, or from the two halves of the thread's share in turn, two streams from memory instead of one
# (common/kernels/vec.h, each_weight_row), each asked for ahead (`reading`).
STREAMS = {"one": 1, "two": 2}
OPERATOR = native.Operator("gemv_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None, bf16_row: str = BF16_ROWS[0], prefetch: bool = False,
         streams: str = "one") -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (fp32 or bf16) -> [M, N] in x's dtype = x @ (w * scale[:, None])^T + bias.

    w [N, K] contiguous float32, bfloat16, or int8 with scale [N] (int8 only); bias [N] or None.
    Products and sums in fp32 (bf16 weights widen exactly), one rounding to x's dtype at the end. Over
    int8 weights x is first rounded as round_blocks does and each block's products are summed in int32.
    bf16_row: one of BF16_ROWS, the loop for bf16 x over bf16 weights on a CPU with the bf16 dot product.
    prefetch: ask for the weight PREFETCH_BYTES ahead of the row being read (not in bf16_row interleave4, nor
    in the portable loop of CPUs without AVX2); streams: one of STREAMS, the order each thread reads its weight rows
    in (as prefetch, not in the portable loop); the same sums either way.
    Each row's result is the same whatever the other rows of x and the thread count.
    """
    if bf16_row not in BF16_ROWS:
        raise ValueError(f"gemv: bf16_row {bf16_row!r}: expected one of {', '.join(BF16_ROWS)}")
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    load().gemv(out, x.contiguous(), w, None if scale is None else scale.float(),
                None if bias is None else bias.float(), BF16_ROWS.index(bf16_row), *reading(prefetch, streams))
    return out


def reading(prefetch: bool, streams: str = "one") -> tuple[int, int]:
    """The kernels' (ahead, streams) for a Linear's `gemv_prefetch` and `gemv_streams`: the prefetch distance in
    bytes (0: none) and the streams each thread reads its weight rows in. Two streams are always asked for ahead:
    without it they read a decode step's bf16 and int8 weights slower than one did (Intel Xeon, family 6 model 167)."""
    count = STREAMS[streams]
    return (PREFETCH_BYTES if prefetch or count > 1 else 0), count


def round_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> fp32 [M, K], each block of QBLOCK inputs (the last may be shorter) rounded to int8 steps
    of its own scale max|block| / 127 (1 for an all-zero block), ties to even, and scaled back."""
    m, k = x.shape
    pad = -k % QBLOCK
    blocks = F.pad(x.float(), (0, pad)).view(m, -1, QBLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(blocks / scale).clamp(-127, 127) * scale).view(m, -1)[:, :k]


def gemv_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: F.linear in fp32 over the widened (and scaled) weight, fp32 result; over
    int8 weights, of x rounded by round_blocks."""
    wf = w.float() if scale is None else w.float() * scale.float()[:, None]
    xf = round_blocks(x) if w.dtype == torch.int8 else x.float()
    return F.linear(xf, wf, None if bias is None else bias.float())


if __name__ == "__main__":
    OPERATOR.main()
