"""nn.Linear with an optional oneDNN-packed copy of its weight for CPU matmuls.

The packed matmul (services/common/onednn.py) is about 2x faster than F.linear in fp32
on CPU; that matmul is ~90% of a decode step, so the runner packs every projection and
the LM head at load.

The module stays an nn.Linear with its dense `weight` (the adapter bank wraps q/k/v/o/
gate/up/down_proj by name and reads their shapes); the packed tensor is an extra, opaque
copy used only by forward. Torch's inductor uses these same ops for frozen CPU linears.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common import onednn


class Linear(nn.Linear):
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in_features] -> [N, out_features]."""
        if self.packed is not None:
            return onednn.linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> None:
        """Reorder the weight for oneDNN (CPU fp32/bf16 only); later forwards use the packed copy."""
        self.packed = onednn.pack(self.weight)


def pack_linears(model: nn.Module) -> str:
    """Pack every Linear of a CPU model when oneDNN is there; returns the matmul path in use."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or not onednn.available(linears[0].weight.device):
        return "torch"
    for m in linears:
        m.pack()
    return "onednn-packed"
