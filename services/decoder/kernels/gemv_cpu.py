"""Few-row (decode) matmul on CPU that streams each weight row once: a C++ operator and its torch ref.

The kernel is gemv_cpu.cpp next to this file, compiled once per machine by native.load (`make
kernels`). `gemv` is the launcher, `gemv_ref` the torch computation it must match. Whether it
beats the library matmul at a given shape and row count is measured at load
(services/decoder/model/linear.py); this module only computes.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from services.common import native

SOURCE = Path(__file__).with_suffix(".cpp")
MAX_ROWS = 4          # the kernel keeps every row of x in registers' reach; more rows go to GEMMs
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
OPERATOR = native.Operator("gemv_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] (fp32 or bf16) -> [M, N] in x's dtype = x @ (w * scale[:, None])^T + bias.

    w [N, K] contiguous float32, bfloat16, or int8 with scale [N] (int8 only); bias [N] or None.
    Products and sums in fp32 (bf16 and int8 weights widen exactly), one rounding to x's dtype at the end.
    """
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    load().gemv(out, x.contiguous(), w, None if scale is None else scale.float(),
                None if bias is None else bias.float())
    return out


def gemv_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: F.linear in fp32 over the widened (and scaled) weight, fp32 result."""
    wf = w.float() if scale is None else w.float() * scale.float()[:, None]
    return F.linear(x.float(), wf, None if bias is None else bias.float())


if __name__ == "__main__":
    OPERATOR.main()
