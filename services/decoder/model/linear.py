"""nn.Linear with an optional oneDNN-packed copy of its weight, used by row count.

The projections and LM head are ~90% of a decode step on CPU. Whether the packed matmul
beats F.linear depends on the CPU and the number of rows (services/common/linear_path.py),
so `pack_linears` times both at load per weight shape and each Linear keeps the `Rule`
for its shape; forward picks the path from x.shape[0].

The module stays an nn.Linear with its dense `weight` (the adapter bank wraps q/k/v/o/
gate/up/down_proj by name and reads their shapes; the plain path reads it); the packed
tensor is an extra, opaque copy, kept only where some row count uses it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common import linear_path


class Linear(nn.Linear):
    packed: torch.Tensor | None = None
    rule: linear_path.Rule | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in_features] -> [N, out_features]."""
        packed = self.packed
        if packed is not None and self.rule.use_packed(x.shape[0]):
            return linear_path.packed_linear(x, packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def adopt(self, plan: linear_path.Plan) -> None:
        """Take plan's rule for this weight's shape; pack the weight if the rule ever uses it."""
        self.rule = plan.rule(self.weight, self.bias)
        self.packed = linear_path.pack(self.weight) if self.rule.ever_packed else None


def pack_linears(model: nn.Module, mode: str | None = None) -> str:
    """Choose the matmul path per weight shape of every Linear of model (auto: by timing;
    see linear_path.MODES) and pack where used. Returns the plan's one-line summary."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    plan = linear_path.plan(((m.weight, m.bias) for m in linears), mode)
    for m in linears:
        m.adopt(plan)
    return plan.summary
