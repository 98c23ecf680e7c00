"""int8 weights (`--quantization int8`): per-output-channel symmetric int8 weights. (`--quantization int4`
holds grouped 4-bit weights instead: model/grouped.py, model/linear.py.)

At batch 1 a decode step reads every weight once, so the bytes read decide its time
(the projections and LM head are ~85% of a batch-1 step). int8 weights are a
quarter of fp32's bytes and half of bf16's. The matmul is torch's own CPU kernel,
aten._weight_int8pack_mm: y = (x @ q^T) * scale, accumulated in fp32. Its vectorised
path takes bf16 activations (with fp32 activations it runs scalar code, ~7x slower than
bf16 on a Zen 4), so the projection's input is rounded to bf16 and its bf16 output cast
back to the model's dtype. That is one bf16 rounding on each side of every quantized
matmul; the int8 weights themselves are the larger error (a step of max|w|/127 per row).

The kernel reads K in whole vectors and gives wrong sums (or crashes) when K is not a
multiple of 16 on this torch, so such weights stay dense (`eligible`), and the summary
says how many did. Decode steps of a few rows may instead run kernels/gemv_cpu.cpp over the
same int8 weights and scales, where it was measured faster at load (model/linear.py,
choose_gemv); it rounds the activations to int8 in blocks of 32 (gemv_cpu.round_blocks).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch reference: fp32 F.linear over the dequantized weight (tests)."""
    return F.linear(x.float(), dequantize(q, scale), None if bias is None else bias.float())
