"""bf16 matmul of many decode rows over a weight packed in 64-column panels, on CPU: the launcher and
its torch ref.

The kernel is tile_gemm_cpu.cpp next to this file (decode_stack_cpu.cpp includes it), compiled once
per machine by native.load (`make kernels`); it needs avx512_bf16 (`available`). Whether the decode
stack runs its projections through it is measured at load (runner/fused_decode.py); this module only
computes.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from services.common import native

SOURCE = Path(__file__).with_suffix(".cpp")
COLS = 64             # columns per panel: a weight needs out_features % COLS == 0 and an even in_features
OPERATOR = native.Operator("tile_gemm_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def available() -> bool:
    """Whether the kernel runs here (built, and the CPU has the bf16 dot product)."""
    try:
        return load().available()
    except native.BuildError:
        return False


def fits(w: torch.Tensor) -> bool:
    """Whether w [N, K] can be packed: bf16, N a multiple of COLS, K even."""
    return w.dim() == 2 and w.dtype == torch.bfloat16 and w.shape[0] % COLS == 0 and w.shape[0] > 0 \
        and w.shape[1] % 2 == 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bf16 -> [N / 64, K / 2, 64, 2] bf16: panel p, pair k, column j = w[64p + j, 2k:2k + 2]."""
    return load().pack(w)


def tile_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 -> fp32 [M, N] = x @ w^T (+ bias), packed = pack(w): exact products, fp32 sums."""
    out = torch.empty((x.shape[0], packed.shape[0] * COLS), dtype=torch.float32)
    load().tile_gemm(out, x.contiguous(), packed, None if bias is None else bias.float().contiguous())
    return out


def tile_gemm_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: F.linear in fp32 over the widened weight, fp32 result."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float())


if __name__ == "__main__":
    OPERATOR.main()
