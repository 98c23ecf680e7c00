"""Grouped weights (`--quantization int4`, and GGUF's 4- and 8-bit blocks): codes with a scale and an
offset per group of inputs.

A weight [N, K] is stored as unsigned `bits`-bit codes (4 or 8) and, per output row and group of
`group` consecutive inputs (16 or 32; it divides K), an fp16 scale and offset:

    w[n, k] = scale[n, k // group] * code[n, k] + offset[n, k // group],   0 <= code < 2**bits.

At batch 1 a decode step reads every weight once, so its time is the bytes read: 4-bit codes with two
fp16 numbers per 32 inputs are 5 bits a weight (llama.cpp's Q4_0 is 4.5, bf16 is 16). The kernel
(kernels/gemv_grouped.h) computes per group scale * (x . code) + offset * sum(x), with sum(x) per group
once per row of x.

Storage (`GroupedWeight`):
- bits 4: `codes` uint8 [N, K // 2]. Each group takes group / 2 bytes; byte j of a group holds the
  group's code j in its low nibble and code j + group / 2 in its high nibble (llama.cpp's Q4_0 order),
  so one AND and one shift of a vector of bytes give two runs of whole groups' codes.
- bits 8: `codes` uint8 [N, K], one code a byte.
- `scale`, `offset`: fp16 [N, K // group]. `pack` rounds what it is given to fp16. GGUF's K-quants give
  each group a scale d * sc (a 6-bit sc times an fp16 super-block d) and an offset -dmin * m: rounded to
  fp16, those are off by at most 2**-11 of themselves, far below a 4-bit step (1/15 of the group's
  range), so one storage serves every format the GGUF loader maps here.

`quantize` is what `--quantization int4` does to a checkpoint's float weights: asymmetric min/max per
group. `dequantize` is the torch reference the kernels are tested against, `expand` the same values from the
C++ kernel in one pass; `grouped_linear` is the matmul by whichever path the caller names
(model/matmul_choice.py chooses one per shape at load).

torch's 4-bit kernel computes w = (code - 8) * scale + zero with scale and zero in x's dtype: zero is
offset + 8 * scale here. For fp32 x that is the same weight; for bf16 x, scale and zero are rounded to
bf16 (relative 2**-9, still well below a 4-bit step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.common import native
from services.decoder.kernels import gemv_cpu, gemv_grouped_cpu, widen_gemm_cpu

BITS = (4, 8)
GROUPS = (16, 32)
# The matmul paths over a grouped weight: the few-row kernel (kernels/gemv_grouped_cpu, up to its MAX_ROWS),
# and for more rows the weight dequantized to x's dtype and the library matmul, torch's own 4-bit kernel
# (aten._weight_int4pack_mm_for_cpu) over its packing of the weight (`Int4Pack`) where the weight fits it, or
# the weight widened block by block in cache (kernels/widen_gemm_cpu) where the CPU runs that kernel.
PATHS = ("gemv", "dequant", "int4pack", "tiles", "amx")
# What torch's 4-bit kernel takes: groups of 32 (or more), out_features a multiple of 16.
INT4PACK_GROUP, INT4PACK_N = 32, 16


@dataclass(frozen=True)
class GroupedWeight:
    """codes uint8 [N, K * bits // 8] (layout in the module docstring); scale, offset fp16 [N, K // group]."""
    bits: int
    group: int
    out_features: int
    in_features: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group
        if self.bits not in BITS:
            raise ValueError(f"grouped weight: bits {self.bits}: expected one of {BITS}")
        if g not in GROUPS or k % g:
            raise ValueError(f"grouped weight: group {g} must be one of {GROUPS} and divide in_features {k}")
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (n, k * self.bits // 8):
            raise ValueError(f"grouped weight: codes must be uint8 [{n}, {k * self.bits // 8}], "
                             f"got {self.codes.dtype} {list(self.codes.shape)}")
        for name in ("scale", "offset"):
            t = getattr(self, name)
            if t.dtype != torch.float16 or tuple(t.shape) != (n, k // g):
                raise ValueError(f"grouped weight: {name} must be float16 [{n}, {k // g}], "
                                 f"got {t.dtype} {list(t.shape)}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def describe(self) -> str:
        return f"int{self.bits}/g{self.group}"

    def rows(self, start: int, stop: int) -> GroupedWeight:
        """Output rows [start, stop) as a GroupedWeight of views (a row's codes, scales and offsets are contiguous)."""
        return GroupedWeight(self.bits, self.group, stop - start, self.in_features, self.codes[start:stop],
                             self.scale[start:stop], self.offset[start:stop])


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, group: int) -> GroupedWeight:
    """codes [N, K] (one unsigned code a byte, < 2**bits), scale and offset [N, K // group] (any float
    dtype; rounded to fp16 here) -> the GroupedWeight they describe."""
    if codes.dim() != 2:
        raise ValueError(f"grouped weight: codes must be [N, K], got {list(codes.shape)}")
    n, k = codes.shape
    if bits not in BITS:
        raise ValueError(f"grouped weight: bits {bits}: expected one of {BITS}")
    if group not in GROUPS or k % group:
        raise ValueError(f"grouped weight: group {group} must be one of {GROUPS} and divide in_features {k}")
    c = codes.to(torch.int32)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
        raise ValueError(f"grouped weight: codes must lie in [0, {1 << bits})")
    s16, o16 = scale.to(torch.float16).contiguous(), offset.to(torch.float16).contiguous()
    if not (torch.isfinite(s16).all() and torch.isfinite(o16).all()):
        raise ValueError("grouped weight: a scale or offset is not finite in fp16")
    if bits == 4:
        halves = c.view(n, k // group, 2, group // 2)
        packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)
    else:
        packed = c
    return GroupedWeight(bits, group, n, k, packed.to(torch.uint8).contiguous(), s16, o16)


def unpack_codes(gw: GroupedWeight) -> torch.Tensor:
    """The codes as given to pack: uint8 [N, K]."""
    return gemv_grouped_cpu.unpack_codes(gw.codes, gw.bits, gw.group)


def regroup(gw: GroupedWeight, bits: int, group: int) -> GroupedWeight:
    """gw in a format at least as fine (bits >= gw.bits, group dividing gw.group), holding the same weights exactly:
    the codes as they are, each group's scale and offset repeated over its parts. What lets projections stored in
    different formats (a GGUF file's Q4_K q and k beside a Q6_K v) be fused into one matmul."""
    if (bits, group) == (gw.bits, gw.group):
        return gw
    if bits < gw.bits or gw.group % group:
        raise ValueError(f"grouped weight: {gw.describe()} cannot be held as int{bits}/g{group} exactly")
    parts = gw.group // group
    return pack(unpack_codes(gw), gw.scale.repeat_interleave(parts, dim=1), gw.offset.repeat_interleave(parts, dim=1),
                bits, group)


# The dequant path widens a weight this many bytes of output rows at a time. Widened whole, the weight is written
# to memory and read back, and from 32 MiB (glibc's largest mmap threshold) its buffer is a fresh mapping every
# call, faulted in page by page: ~8 ms a call for an 8192x2048 weight in bf16 on a Zen 5, against 2 ms for its
# 32-row matmul. A piece this size comes back from the heap and is still in cache for its matmul.
DEQUANT_PIECE_BYTES = 8 << 20


def dequantize(gw: GroupedWeight) -> torch.Tensor:
    """fp32 [N, K]: scale * code + offset per group, in fp32 from the fp16 scale and offset (the torch reference)."""
    return gemv_grouped_cpu.dequantize(gw.codes, gw.scale, gw.offset, gw.bits, gw.group)


def expand(gw: GroupedWeight, dtype: torch.dtype) -> torch.Tensor:
    """dequantize(gw).to(dtype): for fp32 and bf16 by the C++ kernel in one pass over the codes (bit for bit the
    same); by the torch reference for other dtypes and where the kernels are not built (the load-time gemv choice
    logs that as a WARNING)."""
    if dtype in widen_gemm_cpu.DTYPES:
        try:
            return widen_gemm_cpu.dequantize(gw.codes, gw.scale, gw.offset, gw.bits, gw.group, dtype)
        except native.BuildError:
            pass
    return dequantize(gw).to(dtype)


@torch.no_grad()
def quantize(weight: torch.Tensor, bits: int = 4, group: int = 32) -> GroupedWeight:
    """weight [N, K] float -> GroupedWeight: per group, offset = min, scale = (max - min) / (2**bits - 1),
    both rounded to fp16 first; code = round((w - offset) / scale) clamped to [0, 2**bits). A constant
    group (scale 0 in fp16) gets codes 0."""
    if weight.dim() != 2 or weight.shape[1] % group:
        raise ValueError(f"grouped weight: group {group} must divide in_features {weight.shape[-1]}")
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    top = (1 << bits) - 1
    offset = lo.to(torch.float16).float()
    scale = ((hi - offset) / top).to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((w - offset[:, :, None]) / safe[:, :, None]).clamp_(0, top)
    codes = torch.where(scale[:, :, None] > 0, codes, torch.zeros_like(codes))
    return pack(codes.to(torch.uint8).view(n, k), scale, offset, bits, group)


round_groups = gemv_grouped_cpu.round_groups    # x as the few-row kernel rounds it (per group, to int8 steps)


def grouped_linear_ref(x: torch.Tensor, gw: GroupedWeight, bias: torch.Tensor | None = None,
                       rounded: bool = False) -> torch.Tensor:
    """The torch reference, fp32 [M, N]: F.linear over the dequantized weight; rounded: of x rounded as
    the few-row kernel does (round_groups)."""
    xf = round_groups(x, gw.group) if rounded else x.float()
    return F.linear(xf, dequantize(gw), None if bias is None else bias.float())


def dequantized_linear(x: torch.Tensor, gw: GroupedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Many rows: the weight dequantized to x's dtype DEQUANT_PIECE_BYTES of output rows at a time, each piece
    then the library matmul. x [M, K] -> [M, N]."""
    b = None if bias is None else bias.to(x.dtype)
    step = max(1, DEQUANT_PIECE_BYTES // (gw.in_features * x.element_size()))
    if step >= gw.out_features:
        return F.linear(x, expand(gw, x.dtype), b)
    y = x.new_empty(*x.shape[:-1], gw.out_features)
    for start in range(0, gw.out_features, step):
        stop = min(start + step, gw.out_features)
        y[..., start:stop] = F.linear(x, expand(gw.rows(start, stop), x.dtype), None if b is None else b[start:stop])
    return y


@dataclass(frozen=True)
class Int4Pack:
    """torch's packing of a 4-bit, group-32 GroupedWeight for aten._weight_int4pack_mm_for_cpu: weight (opaque
    uint8) and scales_and_zeros [K // 32, N, 2] in the activations' dtype."""
    weight: torch.Tensor
    scales_and_zeros: torch.Tensor


def int4pack_fits(gw: GroupedWeight) -> bool:
    """Whether torch's 4-bit kernel takes gw: 4-bit codes, groups of INT4PACK_GROUP, N a multiple of INT4PACK_N."""
    return gw.bits == 4 and gw.group == INT4PACK_GROUP and gw.out_features % INT4PACK_N == 0


def int4pack(gw: GroupedWeight, dtype: torch.dtype) -> Int4Pack:
    """gw (int4pack_fits) in torch's packing, for activations of `dtype`."""
    if not int4pack_fits(gw):
        raise ValueError(f"int4pack: {gw.describe()} {gw.out_features}x{gw.in_features} does not fit torch's "
                         f"4-bit kernel (4-bit, groups of {INT4PACK_GROUP}, out_features a multiple of {INT4PACK_N})")
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_codes(gw).to(torch.int32), 1)
    s, o = gw.scale.float(), gw.offset.float()
    sz = torch.stack([s, o + 8 * s], dim=2).transpose(0, 1).contiguous().to(dtype)
    return Int4Pack(weight, sz)


def grouped_linear(x: torch.Tensor, gw: GroupedWeight, bias: torch.Tensor | None = None, path: str = "dequant",
                   packed: Int4Pack | None = None, loop: str = gemv_grouped_cpu.WIDEST[0],
                   prefetch: bool = False, streams: str = "one") -> torch.Tensor:
    """x [M, K] (fp32 or bf16) -> [M, N] in x's dtype = x @ w^T + bias, by `path` (PATHS): gemv (M <= 4 rows; x
    rounded to int8 per group, kernels/gemv_grouped_cpu by `loop`, one of its WIDEST, asking for rows ahead where
    `prefetch`, in the order `streams` gives: gemv_cpu.STREAMS), dequant, int4pack
    (packed = int4pack(gw, x.dtype)), tiles (kernels/widen_gemm_cpu; where it is `available`) or amx (the same on
    the tile unit; where `amx()`)."""
    if path == "gemv":
        return gemv_grouped_cpu.gemv_grouped(x, gw.codes, gw.scale, gw.offset, gw.bits, gw.group, bias, loop,
                                             *gemv_cpu.reading(prefetch, streams))
    if path == "dequant":
        return dequantized_linear(x, gw, bias)
    if path in widen_gemm_cpu.PATH_KERNELS:
        return widen_gemm_cpu.gemm_grouped(x, gw.codes, gw.scale, gw.offset, gw.bits, gw.group, bias,
                                           kernel=widen_gemm_cpu.PATH_KERNELS[path])
    if path == "int4pack":
        if packed is None:
            raise ValueError("grouped_linear: the int4pack path needs the weight's Int4Pack")
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed.weight, INT4PACK_GROUP,
                                                       packed.scales_and_zeros.to(x.dtype))
        return y if bias is None else y.add_(bias.to(y.dtype))
    raise ValueError(f"grouped_linear: path {path!r}: expected one of {', '.join(PATHS)}")
