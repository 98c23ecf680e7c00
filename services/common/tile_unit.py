"""Dense weights on the CPU's tile unit (AMX with bf16), for the decoder and the pooling service. A C++ operator.

- A bf16 weight's panels (`pack_panels`: laid out once as the unit reads it) and the matmul over them
  (`gemm_panels`, x fp32 or bf16 rounded to bf16, fp32 sums): the decode stack's dense projections.
- An fp32 weight split in bf16 halves (`pack_split_panels`: hi = bf16(w), lo = bf16(w - hi)) and the fp32 matmul
  that forms each product as hi hi + lo hi + hi lo of the operands' halves (`gemm_panels_split`): each of those
  is exact in fp32 and the sums are fp32, so x and w count to about 16 of fp32's 24 bits, what torch's float32
  matmul precision "high" allows ("each float32 number as the sum of two bfloat16 numbers"); the lo lo product,
  below that, is left out. --matmul-precision high lets the services run it (`split_products`, chosen per
  weight shape at load: services/common/split_products.py).

The kernel is kernels/tile_unit_cpu.cpp (kernels/amx_gemm.h), compiled once per machine by native.load
(`make kernels`); it runs where the CPU has AMX with bf16, the build targets it and Linux grants the process its
tile state (`amx`). The torch references: F.linear over the bf16 weight in fp32 (panels), and F.linear in float64
(split). A row's result is the same whatever the other rows.
"""
from __future__ import annotations

from pathlib import Path

import torch

from services.common import native

OPERATOR = native.Operator("tile_unit_cpu", Path(__file__).parent / "kernels" / "tile_unit_cpu.cpp")
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def amx() -> bool:
    """Whether the tile unit runs here: the CPU has AMX with bf16, this build targets it, and Linux lets the process
    use its state."""
    try:
        return load().amx()
    except native.BuildError:
        return False


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] laid out once as the tile unit reads it (amx_gemm.h's panels: 16 x 32 blocks
    transposed by pairs of inputs, zeros to whole pairs of 16 rows and to 32 inputs), for gemm_panels and the
    decode stack; where amx()."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or not amx():
        raise ValueError(f"pack_panels: a bf16 [N, K] weight on a CPU with the tile unit (got {w.dtype}, "
                         f"amx {amx()})")
    out = torch.empty(load().panel_size(w.shape[0], w.shape[1]), dtype=torch.bfloat16)
    load().pack_panels(out, w.contiguous())
    return out


def gemm_panels(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) -> [M, n] in x's dtype = x @ w^T + bias over panels = pack_panels(w), on the tile unit:
    x rounded to bf16, fp32 sums, one rounding. Each row's result is the same whatever the other rows."""
    out = torch.empty((x.shape[0], n), dtype=x.dtype)
    load().gemm_panels(out, x.contiguous(), panels, n, None if bias is None else bias.float().contiguous())
    return out


def pack_split_panels(w: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [N, K] as its two bf16 halves, hi = bf16(w) and lo = bf16(w - hi), each laid out as
    pack_panels does, hi then lo, for gemm_panels_split; where amx(). The weight's own bytes again."""
    if w.dtype != torch.float32 or w.dim() != 2:
        raise ValueError(f"pack_split_panels: an fp32 [N, K] weight (got {w.dtype}, {w.dim()} dims)")
    hi = w.detach().to(torch.bfloat16)
    return torch.cat([pack_panels(hi), pack_panels((w.detach() - hi.float()).to(torch.bfloat16))])


def gemm_panels_split(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, n] fp32 = x @ w^T + bias over panels = pack_split_panels(w), on the tile unit: each
    product as hi hi + lo hi + hi lo of the operands' bf16 halves, fp32 sums. Each row's result is the same whatever
    the other rows."""
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    load().gemm_panels_split(out, x.contiguous(), panels, n, None if bias is None else bias.float().contiguous())
    return out


if __name__ == "__main__":
    OPERATOR.main()
