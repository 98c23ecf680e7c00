"""fp32 or bf16 matmul of many decode rows over a weight packed in 64-column panels, on CPU: the
launcher. Its torch reference is gemv_cpu.gemv_ref (F.linear in fp32 over the widened weight), the
same computation as the few-row kernel's.

The kernel is tile_gemm.h next to this file (bound by tile_gemm_cpu.cpp; decode_stack_cpu.cpp runs it
too), compiled once per machine by native.load (`make kernels`); it needs AVX-512, and for bf16
avx512_bf16 (`available`).
Whether the decode stack runs its projections through it is measured at load (runner/fused_decode.py);
this module only computes.
"""
from __future__ import annotations

from pathlib import Path

import torch

from services.common import native

SOURCE = Path(__file__).with_suffix(".cpp")
COLS = 64             # columns per panel: a weight needs out_features % COLS == 0 (bf16: and an even in_features)
OPERATOR = native.Operator("tile_gemm_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def available(dtype: torch.dtype) -> bool:
    """Whether the kernel runs here for weights of dtype (built, and the CPU has AVX-512; for bf16 also
    the bf16 dot product)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        return load().available(dtype == torch.bfloat16)
    except native.BuildError:
        return False


def fits(w: torch.Tensor) -> bool:
    """Whether w [N, K] can be packed: fp32 or bf16, N a positive multiple of COLS, for bf16 K even."""
    return w.dim() == 2 and w.shape[0] % COLS == 0 and w.shape[0] > 0 and (
        w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0))


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> panels in w's dtype: fp32 [N / 64, K, 64] (panel p, input k, column j = w[64p + j, k]);
    bf16 [N / 64, K / 2, 64, 2] (panel p, pair k, column j = w[64p + j, 2k:2k + 2])."""
    return load().pack(w)


def tile_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
              next_panel: bool = True) -> torch.Tensor:
    """x [M, K] in the weight's dtype -> fp32 [M, N] = x @ w^T (+ bias), packed = pack(w): fp32 sums.
    next_panel: whether a thread asks its next panel into cache while it reads this one (tile_gemm.h `next`);
    the same sums either way."""
    out = torch.empty((x.shape[0], packed.shape[0] * COLS), dtype=torch.float32)
    load().tile_gemm(out, x.contiguous(), packed, None if bias is None else bias.float().contiguous(), next_panel)
    return out


if __name__ == "__main__":
    OPERATOR.main()
