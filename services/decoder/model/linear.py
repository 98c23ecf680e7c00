"""nn.Linear with an optional oneDNN-packed copy of its weight, used by row count.

The projections and LM head are ~90% of a decode step on CPU. Whether the packed matmul
beats F.linear depends on the CPU and the number of rows (services/common/linear_path.py),
so `pack_linears` times both at load per weight shape and each Linear keeps the `Rule`
for its shape; forward picks the path from x.shape[0].

The module stays an nn.Linear with its dense `weight` (the adapter bank wraps q/k/v/o/
gate/up/down_proj by name and reads their shapes; the plain path reads it); the packed
tensor is an extra, opaque copy, kept only where some row count uses it. Under
`--quantization int8` (model/quantization.py) a Linear holds an int8 weight and per-row
scales instead, used at every row count, and its dense weight is released unless another
module shares it (a tied LM head's is the embedding table).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common import linear_path
from services.decoder.model import quantization


class Linear(nn.Linear):
    packed: torch.Tensor | None = None
    rule: linear_path.Rule | None = None
    qweight: torch.Tensor | None = None     # [out, in] int8 (quantization.quantize)
    qscale: torch.Tensor | None = None      # [out]

    @property
    def released(self) -> bool:
        """True once the weight moved elsewhere (fused, or quantized) and the dense copy was dropped."""
        return self.weight.numel() == 0

    def correct(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """What this projection adds to base output y [N, out] of x [N, in]; a base Linear adds
        nothing (LoraLinear adds each row's adapter). Lets a fused projection's slices be corrected."""
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in_features] -> [N, out_features]."""
        if self.qweight is not None:
            return quantization.int8_linear(x, self.qweight, self.qscale, self.bias)
        packed = self.packed
        if packed is not None and self.rule.use_packed(x.shape[0]):
            return linear_path.packed_linear(x, packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def adopt(self, plan: linear_path.Plan) -> None:
        """Take plan's rule for this weight's shape; pack the weight if the rule ever uses it."""
        self.rule = plan.rule(self.weight, self.bias)
        self.packed = linear_path.pack(self.weight) if self.rule.ever_packed else None


    @torch.no_grad()
    def quantize(self, release: bool) -> None:
        """Switch to the int8 path; release: drop the dense weight (nothing else reads it)."""
        self.qweight, self.qscale = quantization.quantize(self.weight)
        if release:
            self.release()

    def release(self) -> None:
        """Drop the dense weight (in/out_features, dtype and device stay readable)."""
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


@torch.no_grad()
def fuse(parts: list[Linear]) -> Linear:
    """One Linear whose output is the parts' outputs side by side ([N, sum of out_features]);
    the parts' dense weights are released (they stay as modules: names, adapters, `correct`)."""
    first = parts[0]
    if len({(p.in_features, p.weight.dtype, p.weight.device, p.bias is None) for p in parts}) != 1:
        raise ValueError("fused projections need the same input width, dtype, device and bias presence")
    fused = Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                   device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    for p in parts:
        p.release()
    return fused


def quantize_linears(model: nn.Module, mode: str) -> str:
    """Quantize every eligible Linear of model (mode in quantization.MODES); a one-line summary
    for the log and GetModelInfo, e.g. "int8: 211 of 211 linears" or "none"."""
    if mode not in quantization.MODES:
        raise ValueError(f"quantization {mode!r}: choose from {', '.join(quantization.MODES)}")
    if mode == "none":
        return "none"
    linears = [m for m in model.modules() if isinstance(m, Linear) and not m.released]
    devices = {m.weight.device.type for m in linears} - {"cpu"}
    if devices:
        raise ValueError(f"--quantization {mode} runs on CPU only (the weights are on {', '.join(sorted(devices))})")
    # A weight that some other module also holds (a tied LM head's embedding table) stays.
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    chosen = [m for m in linears if quantization.eligible(m.weight)]
    for m in chosen:
        m.quantize(release=id(m.weight) not in shared)
    left = f"; {len(linears) - len(chosen)} dense (in_features not a multiple of {quantization.K_MULTIPLE})" \
        if len(chosen) < len(linears) else ""
    return f"{mode}: {len(chosen)} of {len(linears)} linears{left}"


def pack_linears(model: nn.Module, mode: str | None = None) -> str:
    """Choose the matmul path per weight shape of every dense Linear of model (auto: by timing;
    see linear_path.MODES) and pack where used. Returns the plan's one-line summary."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and not m.released and m.qweight is None]
    if not linears:
        return "none: every linear is int8"
    plan = linear_path.plan(((m.weight, m.bias) for m in linears), mode)
    for m in linears:
        m.adopt(plan)
    return plan.summary
