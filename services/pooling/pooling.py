"""Pooling math: one vector per sequence from token hidden states.

Padding contributes neither vectors nor a divisor (docs/design.md, invariant 7): the mean
of [h0, h1, pad] is (h0 + h1) / 2.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MODES = ("mean", "cls", "last")


def pool_hidden(hidden: torch.Tensor, mask: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """hidden [B, L, H], mask [B, L] (1/True = real token) -> [B, H] float32.

    mean: sum of visible vectors / visible count; cls: position 0 (must be visible);
    last: the last visible position per row, so right and left padding both work.
    """
    if hidden.ndim != 3 or mask.shape != hidden.shape[:2]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and mask {tuple(mask.shape)} do not match")
    visible = mask.bool()
    if not visible.any(-1).all():
        raise ValueError("every sequence needs at least one visible token")
    if mode == "mean":
        weights = visible.to(torch.float32).unsqueeze(-1)
        result = (hidden.float() * weights).sum(1) / weights.sum(1)
    elif mode == "last":
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(visible)
        index = positions.masked_fill(~visible, -1).max(1).values
        result = hidden[torch.arange(hidden.shape[0], device=hidden.device), index].float()
    elif mode == "cls":
        if not visible[:, 0].all():
            raise ValueError("cls pooling needs an unpadded first token (left padding is not allowed)")
        result = hidden[:, 0].float()
    else:
        raise ValueError(f"pooling mode must be one of {MODES}, not {mode!r}")
    return F.normalize(result, dim=-1) if normalize else result


def shorten(vectors: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation [B, H] -> [B, dimensions]; re-normalised when the model normalises,
    so that a dot product stays a cosine."""
    cut = vectors[:, :dimensions]
    return F.normalize(cut, dim=-1) if normalize else cut.contiguous()
