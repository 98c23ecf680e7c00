"""Few-row (decode) matmul on CPU over grouped 4/8-bit weights (model/grouped.py's layout): a C++ operator.

The kernel is gemv_grouped_cpu.cpp next to this file (gemv_grouped.h), compiled once per machine by
native.load (`make kernels`). `gemv_grouped` is the launcher, `gemv_grouped_ref` the torch computation it
must match (over `dequantize`d weights and x rounded by `round_groups`; model/grouped.py builds on these).
Whether it beats the many-row paths at a shape
and row count is measured at load (services/decoder/model/matmul_choice.py); this module only computes.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from services.common import native
from services.decoder.kernels import gemv_cpu

SOURCE = Path(__file__).with_suffix(".cpp")
MAX_ROWS = gemv_cpu.MAX_ROWS   # as gemv_cpu: 4 rows of x in registers, the rest over the weight row again from L1
# The kernel's loops (gemv_grouped.h's Loop): the widest the CPU runs (AVX512-VNNI, else AVX2, else portable) in
# two orders of work, `pairs` (two chunks of codes a step, the offsets in a pass of their own) and `chunks` (one
# chunk a step); the AVX2 loop in one-chunk steps; the portable one; the AVX2 loop in two-chunk steps. Models run
# one of WIDEST (the plan's `gemv_grouped_loop`, timed at load: model/matmul_choice.py); tests run each the CPU
# has (`runs`).
LOOPS = ("pairs", "avx2", "portable", "chunks", "avx2_pairs")
WIDEST = ("chunks", "pairs")
ACT_DTYPES = (torch.float32, torch.bfloat16)    # the activations it takes
OPERATOR = native.Operator("gemv_grouped_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def gemv_grouped(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                 group: int, bias: torch.Tensor | None = None, loop: str = WIDEST[0], ahead: int = 0,
                 streams: int = 1) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (fp32 or bf16) -> [M, N] in x's dtype = x @ w^T + bias, w [N, K] given by codes uint8
    [N, K * bits // 8], scale and offset fp16 [N, K // group] (model/grouped.py). x is rounded to int8 per group
    (grouped.round_groups); products and sums exact in int32 per group, then fp32; one rounding to x's dtype at
    the end. loop: one of LOOPS (default: the plan's default, WIDEST[0]; the narrower ones are what a CPU
    without the wider runs, and tests run each where it can). ahead: as each row starts, the row this many bytes
    of codes further on is asked for (gemv_cpu.reading; 0: none); streams: each thread's weight rows read front to
    back (1) or from the two halves of its share in turn (2; gemv_cpu.STREAMS); the same sums either way.
    Each row's result is the same whatever the other rows of x and the thread count."""
    out = torch.empty((x.shape[0], codes.shape[0]), dtype=x.dtype)
    load().gemv_grouped(out, x.contiguous(), codes, scale, offset, bits, group,
                        None if bias is None else bias.float().contiguous(), LOOPS.index(loop), ahead,
                        streams)
    return out


def runs(loop: str) -> bool:
    """Whether this CPU runs `loop` (one of LOOPS)."""
    return bool(load().runs(LOOPS.index(loop)))


def vnni() -> bool:
    """Whether WIDEST's loops are the AVX512-VNNI ones (else the AVX2 loop's two orders, or the portable loop)."""
    return bool(load().vnni())


def unpack_codes(codes: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """codes uint8 [N, K * bits // 8] in model/grouped.py's layout -> uint8 [N, K], one code a byte."""
    if bits == 8:
        return codes.clone()
    n = codes.shape[0]
    b = codes.view(n, -1, 1, group // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, -1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """fp32 [N, K]: scale * code + offset per group, in fp32 from the fp16 scale and offset."""
    c = unpack_codes(codes, bits, group).float()
    n, k = c.shape
    c = c.view(n, k // group, group)
    return (c * scale.float()[:, :, None] + offset.float()[:, :, None]).view(n, k)


def round_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] -> fp32 [M, K], each group of `group` inputs rounded to int8 steps of max|group| / 127 (1 for
    an all-zero group), ties to even: what the kernel multiplies the codes with."""
    m, k = x.shape
    blocks = x.float().view(m, k // group, group)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    step = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(blocks / step).clamp(-127, 127) * step).view(m, k)


def gemv_grouped_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                     group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference, fp32 [M, N]: F.linear of x rounded by round_groups over the dequantized weight."""
    return F.linear(round_groups(x, group), dequantize(codes, scale, offset, bits, group),
                    None if bias is None else bias.float())


if __name__ == "__main__":
    OPERATOR.main()
