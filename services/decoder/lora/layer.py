"""A projection that adds each row's own LoRA correction to the shared base output.

The base projection runs once over all rows (the matmul path chosen at load on CPU); then
`lora_apply` adds B_s (A_s x) for every row whose slot s >= 0 (docs/design.md, invariant 6).
The per-step grouping lives in one `LoraStep` that the bank owns, publishes into for
each forward and shares with every layer; when no row of the step uses an adapter it
holds no meta and this layer costs one attribute read over the plain Linear.

On CPU, small (decode-shaped) steps take a padded per-slot form instead of one GEMM
pair per segment: the rows are gathered slot by slot into [S, L, K] (L = the most rows
any slot has), h = bmm(x_s, A_s^T) * keep, y[rows] += bmm(h, Bt_s). Five calls per
projection whatever the number of adapters, and each row pays for its own rank R only
(the dense form, h = x @ A_all^T masked to the row's slot, pays for all S*R
columns: about twice as slow on 2 threads for 32 rows over 8 rank-16 adapters). The bank
picks it per step when rows * S * R is small or the rows are spread evenly over the slots
(see bank.py). Padding rows have keep 0 and base rows are never gathered, so both get
exactly zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.decoder.kernels.lora import lora_apply
from services.decoder.kernels.lora_meta import LoraBatchMeta
from services.decoder.model.linear import Linear


@dataclass
class LoraStep:
    """What one forward's wrapped layers share; the bank (lora/bank.py) fills and clears it.

    meta: the step's row grouping, None when no row uses an adapter.
    dense_index [S*L] rows gathered slot by slot (padding repeats row 0) and
    dense_mask [S, L, 1] (1 for a real row, 0 for padding): the padded per-slot
    form's layout when the bank picked it for this step, else None.
    """

    backend: str
    meta: LoraBatchMeta | None = None
    dense_index: torch.Tensor | None = None
    dense_mask: torch.Tensor | None = None


class LoraLinear(Linear):
    """A Linear with resident slot buffers.

    lora_A [S, R, in_features], lora_B [S, out_features, R]: slot s holds one adapter,
    rank padded to R with zeros, scale folded into B. Plain attributes, not buffers,
    so the module's state_dict keys stay the checkpoint's.
    """

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    lora_Bt: torch.Tensor | None      # [S, R, out_features]: B transposed per slot (CPU padded path only)
    lora_step: LoraStep

    @classmethod
    def install(cls, linear: Linear, step: LoraStep, num_slots: int, max_rank: int) -> LoraLinear:
        """Turn `linear` into a LoraLinear in place and give it zeroed slot buffers.

        Swapping the class (rather than wrapping in a new module) keeps the module's
        name and parameters, its packed oneDNN weight, and avoids one more nn.Module
        call per projection per layer on the base-only path.
        """
        if type(linear) is not Linear:
            raise ValueError(f"cannot install LoRA on {type(linear).__name__}; expected a plain Linear")
        weight = linear.weight
        linear.__class__ = cls
        linear.lora_A = torch.zeros((num_slots, max_rank, linear.in_features), dtype=weight.dtype,
                                    device=weight.device)
        linear.lora_B = torch.zeros((num_slots, linear.out_features, max_rank), dtype=weight.dtype,
                                    device=weight.device)
        linear.lora_Bt = None
        if weight.device.type == "cpu":
            linear.lora_Bt = torch.zeros((num_slots, max_rank, linear.out_features), dtype=weight.dtype)
        linear.lora_step = step
        return linear

    @torch.no_grad()
    def sync_slot(self, slot: int) -> None:
        """Refresh the dense layout of `slot` from lora_B (after a write or clear)."""
        if self.lora_Bt is not None:
            self.lora_Bt[slot].copy_(self.lora_B[slot].t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in_features] -> [N, out_features]: W x (+ bias) + per-row B_s A_s x."""
        return self.correct(x, super().forward(x))

    def correct(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Base output y [N, out_features] of x [N, in_features] (its own matmul or a fused
        projection's slice) + per-row B_s A_s x."""
        step = self.lora_step
        if step.meta is None:
            return y
        y = y.contiguous()       # a fused projection's slice is a strided view; the kernels write rows
        keep = step.dense_mask
        if keep is not None:
            s, width = keep.shape[0], keep.shape[1]
            rows = step.dense_index
            h = torch.bmm(x.index_select(0, rows).view(s, width, -1), self.lora_A.transpose(1, 2)).mul_(keep)
            return y.index_add_(0, rows, torch.bmm(h, self.lora_Bt).view(s * width, -1))
        return lora_apply(y, x, self.lora_A, self.lora_B, step.meta, backend=step.backend)
