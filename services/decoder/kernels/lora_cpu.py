"""Per-row LoRA corrections over a rank-row arena (the CPU adapter pool's kernel contract).

Placeholder: the torch reference only. The C++ kernel (SGMV runs / BGMV lone rows) replaces
`lora_rows` with the same signature and rounding.
"""
from __future__ import annotations

import torch


def lora_rows_ref(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, offsets: torch.Tensor,
                  ranks: torch.Tensor) -> torch.Tensor:
    """y += each row's correction, in place; returns y.

    y [M, N], x [M, K], A [P, K], Bt [P, N] (same dtype), offsets [M], ranks [M] int32:
        for m: o, r = offsets[m], ranks[m]; if r: y[m] += (x[m] @ A[o:o+r].T) @ Bt[o:o+r]
    Sums in fp32; the hidden h and the delta are rounded to y's dtype before the add, as the
    torch path would (h = rnd(x A^T), delta = rnd(h Bt), y = rnd(y + delta)). Rows sharing
    (offset, rank) are computed together; rank-0 rows are not touched at all.
    """
    if not ranks.numel():
        return y
    keys = torch.stack([offsets.to(torch.int64), ranks.to(torch.int64)], dim=1)
    live = keys[:, 1] > 0
    if not bool(live.any()):
        return y
    groups, inverse = torch.unique(keys[live], dim=0, return_inverse=True)
    rows_live = torch.nonzero(live).flatten()
    for g, (o, r) in enumerate(groups.tolist()):
        rows = rows_live[inverse == g]
        h = (x.index_select(0, rows).float() @ A[o:o + r].float().t()).to(y.dtype)
        delta = (h.float() @ Bt[o:o + r].float()).to(y.dtype)
        y[rows] = (y.index_select(0, rows).float() + delta.float()).to(y.dtype)
    return y


lora_rows = lora_rows_ref
