"""int8 weights (`--quantization int8`): per-output-channel symmetric int8 weights. (`--quantization int4`
holds grouped 4-bit weights instead: model/grouped.py, model/linear.py.)

At batch 1 a decode step reads every weight once, so the bytes read decide its time
(the projections and LM head are ~85% of a batch-1 step). int8 weights are a
quarter of fp32's bytes and half of bf16's. The first matmul was torch's own CPU kernel,
aten._weight_int8pack_mm: y = (x @ q^T) * scale, accumulated in fp32. Its vectorised
path takes bf16 activations (with fp32 activations it runs scalar code, ~7x slower than
bf16 on a Zen 4), so the projection's input is rounded to bf16 and its bf16 output cast
back to the model's dtype. That is one bf16 rounding on each side of every quantized
matmul; the int8 weights themselves are the larger error (a step of max|w|/127 per row).

The kernel reads K in whole vectors and gives wrong sums (or crashes) when K is not a
multiple of 16 on this torch, so such weights stay dense (`eligible`), and the summary
says how many did. Decode steps of a few rows may instead run kernels/gemv_cpu.cpp over the
same int8 weights and scales, where it was measured faster at load (model/matmul_choice.py,
choose_gemv); it rounds the activations to int8 in blocks of 32 (gemv_cpu.round_blocks).

Steps of more rows run one of four matmuls over the same int8 weights (`GEMMS`, the `int8_gemm`
path of the execution plan, chosen per weight shape at load by model/matmul_choice.py, choose_int8_gemm):
- `int8pack`: aten._weight_int8pack_mm, as above. On a 2-core Zen 4 it made SmolLM2-135M at 64
  chats slower in int8 than in fp32 (237.7 tok/s against 365.6).
- `dequant`: the weight widened to bf16 one tile of rows at a time into a small scratch (int8 is
  exact in bf16), each tile multiplied by the library's bf16 GEMM (oneDNN; AMX where the CPU has it)
  and the tile's output by its rows' scales in fp32. Same roundings as int8pack (bf16 activations,
  fp32 sums, bf16 output); no bf16 copy of the weight is kept, so int8 still holds a quarter of fp32's bytes.
- `dynamic`: each activation row split into two int8 parts (its rounding to int8 at its own scale, and
  the remainder's at a 254x finer one), both summed exactly in int32 by torch's int8 GEMM (torch._int_mm:
  oneDNN, VNNI or AMX) in one call over twice the rows, then multiplied by the rows' and the output
  channels' scales. The activations lose less than bf16 rounding loses (`dynamic_linear`).
- `tiles`: kernels/widen_gemm_cpu, where the CPU has AVX-512 or AVX2 with FMA: each thread widens 32 rows of the
  weight at a time (AVX2: 16, kernels/widen_gemm_avx2.h) into a buffer in its cache and multiplies every
  activation row against it (in bf16 where the CPU has the bf16 dot product, as `dequant`; else in fp32), the
  fp32 sums times the rows' scales. No library call
  per tile, and no bf16 rounding of the sums before the scales.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from services.decoder.kernels import widen_gemm_cpu

MODES = ("none", "int8", "int4")      # the --quantization choices (server/config.py repeats them torch-free)
# int4 (model/grouped.py): 4-bit codes with an fp16 scale and offset per group of this many inputs; a Linear
# whose in_features it does not divide stays dense.
INT4_GROUP = 32
# The kernel's activation dtype (see the module docstring).
ACT_DTYPE = torch.bfloat16
# in_features must be a multiple of this for the kernel (see the module docstring).
K_MULTIPLE = 16


def eligible(weight: torch.Tensor) -> bool:
    """Whether weight [out, in] can be quantized: in % K_MULTIPLE == 0."""
    return weight.dim() == 2 and weight.shape[1] % K_MULTIPLE == 0


@torch.no_grad()
def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q [out, in] int8 in [-127, 127], scale [out] fp32).

    Symmetric per output channel: scale = max|w_row| / 127, rounded to bf16 (so both kernels,
    _weight_int8pack_mm in bf16 and gemv_cpu in fp32, multiply by the same value), q = round(w / scale).
    A zero row gets scale 1 and q 0.
    """
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).to(ACT_DTYPE).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [out, in] int8, scale [out]) -> the fp32 weight [out, in] the int8 path computes with."""
    return q.float() * scale.float()[:, None]


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] -> [N, out] = x @ dequantize(q, scale)^T + bias, in x's dtype."""
    y = torch.ops.aten._weight_int8pack_mm(x.to(ACT_DTYPE).contiguous(), q, scale.to(ACT_DTYPE)).to(x.dtype)
    return y if bias is None else y.add_(bias)


# Weight bytes widened to bf16 per tile of the dequant path: a tile and its output stay in L2 while
# the GEMM reads them, and one tile is the path's only extra memory.
TILE_BYTES = 1 << 20
# Tiles are whole multiples of this many output rows (a GEMM's column block).
TILE_ROWS = 64


def tile_rows(in_features: int) -> int:
    """Output rows per tile of the dequant path for weights in_features wide (TILE_BYTES of bf16)."""
    return max(TILE_ROWS, TILE_BYTES // (2 * in_features) // TILE_ROWS * TILE_ROWS)


def dequant_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] -> [N, out] = x @ dequantize(q, scale)^T + bias in x's dtype, by a bf16 GEMM over
    one bf16 tile of q's rows (tile_rows) at a time; the scales multiply each tile's bf16 output."""
    xb = x.to(ACT_DTYPE).contiguous()
    out, k = q.shape
    step = min(tile_rows(k), out)
    tile = torch.empty(step, k, dtype=ACT_DTYPE)
    part = torch.empty(x.shape[0] * step, dtype=ACT_DTYPE)
    y = torch.empty(x.shape[0], out, dtype=x.dtype)
    s = scale.float()
    for start in range(0, out, step):
        end = min(start + step, out)
        t, p = tile[:end - start], part[:x.shape[0] * (end - start)].view(x.shape[0], end - start)
        t.copy_(q[start:end])
        torch.mm(xb, t.t(), out=p)
        torch.mul(p, s[start:end], out=y[:, start:end])
    return y if bias is None else y.add_(bias)


def _int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] fp32 -> (round(x / scale) [N, K] as fp32 in [-127, 127], scale [N, 1] = max|row| / 127, 1 for a
    zero row)."""
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale), scale


def dynamic_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] -> [N, out] = x @ dequantize(q, scale)^T + bias in x's dtype, by one int8 GEMM (torch._int_mm,
    exact int32 sums) over 2N rows: each row of x as hi * s + lo * s2, hi its int8 rounding at s = max|row| /
    127 and lo the remainder's at s2 = max|remainder| / 127 <= s / 254. What is left, at most max|row| / 64516,
    is finer than rounding x to bf16 (which the other paths do); one rounding alone (max|row| / 254) was
    coarser than the few-row kernel's blocks of 32 and failed the int8 models' bound in the tests."""
    xf = x.float()
    hi, s = _int8_rows(xf)
    lo, s2 = _int8_rows(xf - hi * s)
    n = x.shape[0]
    acc = torch._int_mm(torch.cat([hi, lo]).to(torch.int8), q.t()).float()
    y = acc[:n].mul_(s).add_(acc[n:].mul_(s2)).mul_(scale.float())
    y = y if bias is None else y.add_(bias)
    return y.to(x.dtype)


@functools.cache
def int_mm_exact() -> bool:
    """Whether torch._int_mm's int32 sums are exact under this process's CPU dispatch. With AVX2 only (no
    VNNI, or ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA capped at it) its byte multiply-adds saturate in int16 and
    `dynamic` is wrong by far more than any tolerance, so it is probed with the products that saturate."""
    g = torch.Generator().manual_seed(0)
    for a, b in ((torch.full((32, 64), 127, dtype=torch.int8), torch.full((64, 32), 127, dtype=torch.int8)),
                 (torch.randint(-127, 128, (32, 576), generator=g, dtype=torch.int8),
                  torch.randint(-127, 128, (576, 64), generator=g, dtype=torch.int8))):
        if not torch.equal(torch._int_mm(a, b), (a.double() @ b.double()).to(torch.int32)):
            return False
    return True


def tiles_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] -> [N, out] = x @ dequantize(q, scale)^T + bias in x's dtype, by kernels/widen_gemm_cpu (where
    widen_gemm_cpu.available(x.dtype))."""
    return widen_gemm_cpu.gemm_int8(x, q, scale, bias)


def amx_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """tiles_linear with the products on the tile unit (bf16; where widen_gemm_cpu.amx())."""
    return widen_gemm_cpu.gemm_int8(x, q, scale, bias, kernel="amx")


# The int8_gemm path's candidates (services/common/plan.py lists the same names; the first is the default).
GEMMS = {"int8pack": int8_linear, "dequant": dequant_linear, "dynamic": dynamic_linear, "tiles": tiles_linear,
         "amx": amx_linear}


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch reference: fp32 F.linear over the dequantized weight (tests)."""
    return F.linear(x.float(), dequantize(q, scale), None if bias is None else bias.float())


def unusable(name: str, dtype: torch.dtype) -> str:
    """Why GEMMS[name] cannot run here for activations of dtype, or "" where it can: `dynamic` where torch._int_mm
    is not exact (int_mm_exact), `tiles` where kernels/widen_gemm_cpu does not run, `amx` where it has no tile unit."""
    if name == "dynamic" and not int_mm_exact():
        return ("torch._int_mm's int32 sums are not exact on this CPU's dispatch (AVX2 byte multiply-adds "
                "saturate)")
    if name == "tiles" and not widen_gemm_cpu.available(dtype):
        return f"this CPU or build has no widen_gemm_cpu kernel for {dtype} (it needs AVX-512 or AVX2 with FMA)"
    if name == "amx" and widen_gemm_cpu.products_for(dtype, "amx") is None:
        return widen_gemm_cpu.NO_TILE_UNIT
    return ""


def usable_gemms(dtype: torch.dtype = torch.float32) -> dict:
    """GEMMS this CPU computes right for activations of dtype (see unusable)."""
    return {name: f for name, f in GEMMS.items() if not unusable(name, dtype)}
