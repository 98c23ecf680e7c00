"""Rotary position embedding with split-half pairing, plain or M-RoPE, under any RoPE recipe (model/rope.py).

Positions are either [N] (text) or [3, N] (M-RoPE: time, height, width). M-RoPE gives
each rotary pair one axis: the first sections[0] pairs follow time, the next sections[1]
height, the rest width. When the three rows are equal every pair reads the same
position, so M-RoPE reduces to plain RoPE bit for bit.

Every path that rotates (the model's layers, the C++ decode stack) takes its cos/sin from cos_sin, so a
recipe holds on all of them. With a partial_rotary_factor (Phi-4-mini) only the first rotary_dim dims of
each head rotate, paired within them; the tables are rotary_dim wide and apply_rotary passes the rest.
"""
from __future__ import annotations

import torch

from services.decoder.model.rope import RopeScaling, check_dims, dynamic_frequencies, inverse_frequencies


class Rotary:
    """cos/sin tables for one step, computed once and shared by every layer."""

    def __init__(self, head_dim: int, rope: RopeScaling | float, sections: tuple[int, int, int] | None = None,
                 device: torch.device | str = "cpu"):
        self.sections = sections
        self.rope = rope if isinstance(rope, RopeScaling) else RopeScaling(theta=float(rope))
        if sections is not None and (self.rope.kind != "default" or self.rope.partial_rotary_factor != 1.0):
            raise ValueError(f"M-RoPE sections take unscaled RoPE over whole heads, not {self.rope.describe()!r}")
        check_dims(self.rope, head_dim)
        self.head_dim = head_dim
        # The tables' width D below: the rotating dims of a head (head_dim unless partial).
        self.rotary_dim = dim = self.rope.rotary_dim(head_dim)
        self.device = torch.device(device)
        # The same expressions as transformers' recipes, so fp32 frequencies match exactly (model/rope.py);
        # scale: the attention factor transformers multiplies cos and sin by (yarn, longrope; else 1).
        self.inv_freq, self.scale = inverse_frequencies(self.rope, dim, self.device)    # [D/2]
        self.switch = self.rope.switch_position
        if self.rope.kind == "longrope":     # past original_max_position_embeddings: the long factors
            self.long_inv_freq, _ = inverse_frequencies(
                self.rope, dim, self.device, seq_len=self.rope.original_max_position_embeddings + 1)
        if sections is not None:
            self.pair_axis = torch.repeat_interleave(
                torch.arange(3, device=device), torch.tensor(sections, device=device))  # [D/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] or [3, N] (long) -> cos, sin [N, 1, D] in dtype (angles in fp32), sin with its
        first half negated: the form apply_rotary takes."""
        if positions.ndim == 1:
            freqs = positions.float()[:, None] * self._frequencies(positions)     # [N, D/2]
        elif positions.ndim == 2 and positions.shape[0] == 3:
            if self.sections is None:
                raise ValueError("[3, N] positions need a model with mrope_section")
            per_axis = positions.float()[:, :, None] * self.inv_freq            # [3, N, D/2]
            pairs = torch.arange(self.rotary_dim // 2, device=positions.device)
            freqs = per_axis[self.pair_axis, :, pairs].T                        # [N, D/2]
        else:
            raise ValueError(f"positions must be [N] or [3, N], got {tuple(positions.shape)}")
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]                  # [N, 1, D]
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        sin[..., : self.rotary_dim // 2].neg_()
        return cos.to(dtype), sin.to(dtype)

    def _frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        """inv_freq per token: [D/2] for all of them, or [N, D/2] where a position-dependent recipe
        (dynamic, longrope) reaches past its switch position; each product position * inv_freq is then
        the one transformers forms for that token."""
        if self.switch is None:
            return self.inv_freq
        beyond = positions >= self.switch
        if not bool(beyond.any()):
            return self.inv_freq
        if self.rope.kind == "longrope":
            return torch.where(beyond[:, None], self.long_inv_freq, self.inv_freq)
        table = self.inv_freq.expand(len(positions), -1).clone()
        far, index = torch.unique(positions[beyond], return_inverse=True)
        rows = torch.stack([dynamic_frequencies(self.rope, self.rotary_dim, int(p), str(self.device))
                            for p in far.tolist()])
        table[beyond] = rows[index]
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by cos/sin [N, 1, R] from cos_sin (split-half pairing, as transformers); R < D
    (partial rotary): the first R dims rotate, paired among themselves, and the other D - R pass unchanged.

    transformers computes x * cos + cat(-x2, x1) * sin; with the sign moved into sin's first half
    that is x * cos + cat(x2, x1) * sin, the same products bit for bit (negation is exact), in
    four ops instead of seven per call (this runs twice per layer per step).
    """
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, -1) * sin
    head = x[..., :r]
    return torch.cat((head * cos + head.roll(r // 2, -1) * sin, x[..., r:]), dim=-1)
