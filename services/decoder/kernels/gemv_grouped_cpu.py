"""Few-row (decode) matmul on CPU over grouped 4/8-bit weights (model/grouped.py's layout): a C++ operator.

The kernel is gemv_grouped_cpu.cpp next to this file (gemv_grouped.h), compiled once per machine by
native.load (`make kernels`). `gemv_grouped` is the launcher; its torch reference is
model/grouped.py's grouped_linear_ref(..., rounded=True). Whether it beats the many-row paths at a shape
and row count is measured at load (services/decoder/model/linear.py); this module only computes.
"""
from __future__ import annotations

from pathlib import Path

import torch

from services.common import native

SOURCE = Path(__file__).with_suffix(".cpp")
MAX_ROWS = 4          # as gemv_cpu: every row of x within registers' reach; more rows go to GEMMs
OPERATOR = native.Operator("gemv_grouped_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def gemv_grouped(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                 group: int, bias: torch.Tensor | None = None, portable: bool = False) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (fp32 or bf16) -> [M, N] in x's dtype = x @ w^T + bias, w [N, K] given by codes uint8
    [N, K * bits // 8], scale and offset fp16 [N, K // group] (model/grouped.py). x is rounded to int8 per group
    (grouped.round_groups); products and sums exact in int32 per group, then fp32; one rounding to x's dtype at
    the end. portable: the portable loop, which CPUs without AVX512-VNNI run (tests run it everywhere).
    Each row's result is the same whatever the other rows of x and the thread count."""
    out = torch.empty((x.shape[0], codes.shape[0]), dtype=x.dtype)
    load().gemv_grouped(out, x.contiguous(), codes, scale, offset, bits, group,
                        None if bias is None else bias.float().contiguous(), portable)
    return out


if __name__ == "__main__":
    OPERATOR.main()
