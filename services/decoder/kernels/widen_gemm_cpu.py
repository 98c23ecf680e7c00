"""Many-row matmul on CPU over quantized weights widened block by block in cache: grouped 4/8-bit weights
(model/grouped.py's layout) and int8 weights with a scale per output row (model/quantization.py), on AVX-512 or
AVX2 dot products ("dot") or on the tile unit ("amx"); and a grouped weight's dequantization to fp32 or bf16. A
C++ operator. (Dense weights' panels for the tile unit are services/common/tile_unit.py's.)

The kernel is widen_gemm_cpu.cpp next to this file (widen_gemm.h, amx_gemm.h), compiled once per machine by
native.load (`make kernels`); the matmul needs AVX-512 or AVX2 with FMA (for products in bf16 AVX-512's bf16 dot
product: `products_for`; "amx" AMX with bf16: `amx`), the dequantization runs everywhere. Their torch
references are gemv_grouped_cpu.dequantize (the weight in fp32, then rounded to the dtype: equal bit for bit)
and F.linear over it with x in the products' dtype (the matmul: the same products, fp32 sums in another order);
for int8, F.linear over the codes, times the scales. Whether a shape's many-row matmul runs here or on another
path is measured at load (model/matmul_choice.py); this module only computes.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from services.common import native

SOURCE = Path(__file__).with_suffix(".cpp")
DTYPES = (torch.float32, torch.bfloat16)    # the activations and dequantized weights it takes
# Where the products run: vector FMAs or AVX-512's bf16 dot product (widen_gemm.h), or the tile unit (AMX,
# amx_gemm.h).
KERNELS = ("dot", "amx")
# The execution plan's many-row paths (int8_gemm, grouped_matmul) that run here, and the kernel of each.
PATH_KERNELS = {"tiles": "dot", "amx": "amx"}
NO_TILE_UNIT = "this CPU, build or kernel has no tile unit for widen_gemm_cpu (AMX with bf16)"
OPERATOR = native.Operator("widen_gemm_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def runs(products: torch.dtype) -> bool:
    """Whether this build computes the matmul's products in `products` (fp32: AVX-512, or AVX2 with FMA; bf16:
    AVX-512's bf16 dot product)."""
    if products not in DTYPES:
        return False
    try:
        return load().available(products == torch.bfloat16)
    except native.BuildError:
        return False


def products_for(dtype: torch.dtype, kernel: str = "dot") -> torch.dtype | None:
    """What the matmul on `kernel` multiplies x of `dtype` in here: on "dot", bf16 x in bf16; fp32 x in bf16 where
    the CPU has the bf16 dot product (x and the weight rounded to bf16, relative 2**-9, against a 4-bit step of
    1/15 of the group's range; twice the products a cycle), else in fp32; on "amx", bf16 where `amx()`; None where
    the kernel does not run for it."""
    if dtype not in DTYPES:
        return None
    if kernel == "amx":
        return torch.bfloat16 if amx() else None
    if runs(torch.bfloat16):
        return torch.bfloat16
    return torch.float32 if dtype == torch.float32 and runs(torch.float32) else None


def available(dtype: torch.dtype) -> bool:
    """Whether the many-row matmul runs here for x of dtype (products_for)."""
    return products_for(dtype) is not None


def amx() -> bool:
    """Whether the matmul runs on the tile unit here (kernel "amx", amx_gemm.h: products in bf16): the CPU has AMX
    with bf16, this build targets it, and Linux lets the process use its state."""
    try:
        return load().amx()
    except native.BuildError:
        return False


def _products(x: torch.Tensor, products: torch.dtype | None, kernel: str) -> torch.dtype:
    """The products' dtype for x on `kernel` (KERNELS): as given (fp32 x may pin fp32 or bf16 on "dot"; "amx"
    multiplies in bf16) or products_for(x.dtype); a ValueError where no kernel here computes them."""
    if kernel not in KERNELS:
        raise ValueError(f"widen_gemm: kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    if kernel == "amx":
        if products not in (None, torch.bfloat16) or products_for(x.dtype, kernel) is None:
            raise ValueError(f"widen_gemm: no tile-unit kernel here for {x.dtype} x (products {products}): "
                             f"it needs AMX with bf16, multiplying in bf16")
        return torch.bfloat16
    products = products or products_for(x.dtype)
    if products is None or not runs(products) or (x.dtype == torch.bfloat16 and products != torch.bfloat16):
        raise ValueError(f"widen_gemm: no kernel here for {x.dtype} x (products {products})")
    return products


def gemm_grouped(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                 group: int, bias: torch.Tensor | None = None, products: torch.dtype | None = None,
                 kernel: str = "dot") -> torch.Tensor:
    """x [M, K] (fp32 or bf16) -> [M, N] in x's dtype = x @ w^T + bias, w [N, K] given by codes uint8
    [N, K * bits // 8], scale and offset fp16 [N, K // group]: x and w (as dequantize(..., products) gives it) in
    `products` (default products_for(x.dtype); fp32 x may pin fp32 or bf16), fp32 sums, one rounding to x's dtype.
    Each row's result is the same whatever the other rows of x and the thread count."""
    products = _products(x, products, kernel)
    out = torch.empty((x.shape[0], codes.shape[0]), dtype=x.dtype)
    load().gemm_grouped(out, x.contiguous(), codes, scale, offset, bits, group,
                        None if bias is None else bias.float().contiguous(), products == torch.bfloat16,
                        kernel == "amx")
    return out


def gemm_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              products: torch.dtype | None = None, kernel: str = "dot") -> torch.Tensor:
    """x [M, K] (fp32 or bf16) -> [M, N] in x's dtype = (x @ q^T) * scale + bias, q int8 [N, K], scale [N]: x and
    q (exact in either) in `products` (as gemm_grouped), fp32 sums times the row's fp32 scale, one rounding to
    x's dtype."""
    products = _products(x, products, kernel)
    out = torch.empty((x.shape[0], q.shape[0]), dtype=x.dtype)
    load().gemm_int8(out, x.contiguous(), q, scale.float().contiguous(),
                     None if bias is None else bias.float().contiguous(), products == torch.bfloat16,
                     kernel == "amx")
    return out


def gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
             group: int, bias: torch.Tensor | None, products: torch.dtype) -> torch.Tensor:
    """The torch reference, fp32 [M, N], of gemm_grouped (offset given: weight its codes, scale and offset) or
    gemm_int8 (offset None: weight int8, scale [N]) with products in `products`: F.linear over the same values."""
    xp = x.to(products).float()
    if offset is not None:
        y = F.linear(xp, dequantize(weight, scale, offset, bits, group, products).float())
    else:
        y = F.linear(xp, weight.to(products).float()) * scale.float()
    return y if bias is None else y + bias.float()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] in dtype (fp32 or bf16): scale * code + offset per group in fp32, rounded once to dtype; equal to
    gemv_grouped_cpu.dequantize(...).to(dtype), in one pass over the codes."""
    if dtype not in DTYPES:
        raise ValueError(f"dequantize: dtype {dtype}: expected one of {', '.join(map(str, DTYPES))}")
    out = torch.empty((codes.shape[0], codes.shape[1] * 8 // bits), dtype=dtype)
    load().dequantize(out, codes, scale, offset, bits, group)
    return out


if __name__ == "__main__":
    OPERATOR.main()
