"""The elementwise glue between a decoder layer's matmuls on CPU, one pass per op: launchers and torch refs.

The kernel is glue.h next to this file (bound by glue_cpu.cpp; decode_stack_cpu.cpp runs the same row functions),
compiled once per machine by native.load (`make kernels`). `silu_mul` and `rms_norm` are the
launchers, `silu_mul_ref` and `rms_norm_ref` the torch computations of model/layers.py they must
match (tests/decoder/kernels). Whether the model uses them is decided at load by timing
(model/glue.py); this module only computes.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from services.common import native

SOURCE = Path(__file__).with_suffix(".cpp")
OPERATOR = native.Operator("glue_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, I] (fp32 or bf16; the halves of gate|up are read in place) -> [N, I] =
    SiLU(gate) * up in their dtype."""
    out = torch.empty(gate.shape, dtype=gate.dtype)
    load().silu_mul(out, _unit_columns(gate), _unit_columns(up))
    return out


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (fp32 or bf16, contiguous), weight [H] in x's dtype, residual [N, H] or None ->
    (s, RMSNorm(s)) with s = x + residual (x itself when None), both [N, H] in x's dtype."""
    out = torch.empty_like(x)
    s = None if residual is None else torch.empty_like(x)
    load().rms_norm(out, x, residual, s, weight, float(eps))
    return (x if s is None else s), out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    s = x if residual is None else x + residual
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return s, weight * h.to(s.dtype)


if __name__ == "__main__":
    OPERATOR.main()
