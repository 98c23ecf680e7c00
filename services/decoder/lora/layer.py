"""Each row's own LoRA correction, added to a projection's shared base output.

The base projection runs once over all rows (the matmul path chosen at load on CPU); then
`lora_apply` adds B_s (A_s x) for every row whose slot s >= 0 (docs/design.md, invariant 6).
The per-step grouping lives in one `LoraStep` that the bank owns, publishes into for
each forward and shares with every layer. A projection's `LoraSlots` hang on it as the plain
attribute `Linear.lora` (model/linear.py), which adds `correct` after the base output; when no
row of the step uses an adapter the step holds no meta and that costs two attribute reads.

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


class LoraSlots:
    """The resident slot buffers of one projection, and the correction they make.

    lora_A [S, R, in_features], lora_B [S, out_features, R]: slot s holds one adapter,
    rank padded to R with zeros, scale folded into B. Plain tensors on a plain object, not
    buffers of a module, so the model's state_dict keys stay the checkpoint's.
    """

    def __init__(self, linear: Linear, step: LoraStep, num_slots: int, max_rank: int):
        weight = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.lora_A = torch.zeros((num_slots, max_rank, self.in_features), dtype=weight.dtype, device=weight.device)
        self.lora_B = torch.zeros((num_slots, self.out_features, max_rank), dtype=weight.dtype, device=weight.device)
        # [S, R, out_features]: B transposed per slot (CPU padded path only)
        self.lora_Bt: torch.Tensor | None = None
        if weight.device.type == "cpu":
            self.lora_Bt = torch.zeros((num_slots, max_rank, self.out_features), dtype=weight.dtype)
        self.lora_step = step

    @classmethod
    def install(cls, linear: Linear, step: LoraStep, num_slots: int, max_rank: int) -> LoraSlots:
        """Give `linear` zeroed slot buffers: its forward (and a fused projection's slice of it) then
        adds each row's adapter. The module keeps its name, parameters and packed weight."""
        if not isinstance(linear, Linear):
            raise ValueError(f"cannot install LoRA on {type(linear).__name__}; expected a Linear")
        if linear.lora is not None:
            raise ValueError("this projection already has LoRA slots")
        linear.lora = slots = cls(linear, step, num_slots, max_rank)
        return slots

    @torch.no_grad()
    def sync_slot(self, slot: int) -> None:
        """Refresh the dense layout of `slot` from lora_B (after a write or clear)."""
        if self.lora_Bt is not None:
            self.lora_Bt[slot].copy_(self.lora_B[slot].t())

    def correct(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Base output y [N, out_features] of x [N, in_features] (the projection's own matmul or a
        fused projection's slice) + per-row B_s A_s x."""
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
