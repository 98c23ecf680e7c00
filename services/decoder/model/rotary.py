"""Rotary position embedding with split-half pairing, plain or M-RoPE.

Positions are either [N] (text) or [3, N] (M-RoPE: time, height, width). M-RoPE gives
each rotary pair one axis: the first sections[0] pairs follow time, the next sections[1]
height, the rest width. When the three rows are equal every pair reads the same
position, so M-RoPE reduces to plain RoPE bit for bit.
"""
from __future__ import annotations

import torch


class Rotary:
    """cos/sin tables for one step, computed once and shared by every layer."""

    def __init__(self, head_dim: int, theta: float, sections: tuple[int, int, int] | None = None,
                 device: torch.device | str = "cpu"):
        self.head_dim = head_dim
        self.sections = sections
        # Same expression as transformers' default RoPE so fp32 frequencies match exactly.
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.inv_freq = 1.0 / (theta ** exponent)                       # [D/2]
        if sections is not None:
            self.pair_axis = torch.repeat_interleave(
                torch.arange(3, device=device), torch.tensor(sections, device=device))  # [D/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] or [3, N] (long) -> cos, sin [N, 1, D] in dtype (angles in fp32), sin with its
        first half negated: the form apply_rotary takes."""
        if positions.ndim == 1:
            freqs = positions.float()[:, None] * self.inv_freq                 # [N, D/2]
        elif positions.ndim == 2 and positions.shape[0] == 3:
            if self.sections is None:
                raise ValueError("[3, N] positions need a model with mrope_section")
            per_axis = positions.float()[:, :, None] * self.inv_freq            # [3, N, D/2]
            pairs = torch.arange(self.head_dim // 2, device=positions.device)
            freqs = per_axis[self.pair_axis, :, pairs].T                        # [N, D/2]
        else:
            raise ValueError(f"positions must be [N] or [3, N], got {tuple(positions.shape)}")
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]                  # [N, 1, D]
        sin = angles.sin()
        sin[..., : self.head_dim // 2].neg_()
        return angles.cos().to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by cos/sin [N, 1, D] from cos_sin (split-half pairing, as transformers).

    transformers computes x * cos + cat(-x2, x1) * sin; with the sign moved into sin's first half
    that is x * cos + cat(x2, x1) * sin, the same products bit for bit (negation is exact), in
    four ops instead of seven per call (this runs twice per layer per step).
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
