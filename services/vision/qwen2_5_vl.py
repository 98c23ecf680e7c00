"""The Qwen2.5-VL vision tower, written from the architecture (no transformers at run time).

patches [N, 3*T*P*P] --patch embed (as Qwen2-VL's)--> [N, E]
  --window order: the m*m merge groups regrouped window by window (window_index)-->
  --depth x (RMSNorm -> attention with 2D rotary -> residual; RMSNorm -> SwiGLU MLP with biases -> residual),
    where the blocks in fullatt_block_indexes attend within each frame and every other block within
    each window of window_size pixels (window_size / patch_size / m merge groups a side; windows at the
    right and bottom edges are cut short)-->
  --PatchMerger: RMSNorm ln_q, each m*m group of consecutive rows concatenated -> Linear, GELU, Linear-->
  --back to the image's merge-window-major order (the inverse of window_index)-->
rows [N/m^2, out_hidden_size]  (the decoder's width)

The regrouping moves whole merge groups, so the merger still finds each group's m*m rows together.
The patch embedding, rotary and attention are Qwen2-VL's (tower.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.vision import tower
from services.vision.tower import ACTIVATIONS, Attention, Grid

MODEL_TYPE = "qwen2_5_vl"


@dataclass(frozen=True)
class TowerConfig:
    """vision_config of a Qwen2.5-VL config.json (embed_dim is its hidden_size, out_width its out_hidden_size)."""

    depth: int
    embed_dim: int
    intermediate_size: int
    num_heads: int
    out_width: int
    fullatt_block_indexes: tuple[int, ...]
    window_size: int = 112
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_config_json(cls, path: Path) -> TowerConfig:
        v, text, theta = tower.vision_config(path)
        full = v.get("fullatt_block_indexes", (7, 15, 23, 31))
        cfg = cls(depth=int(v["depth"]), embed_dim=int(v["hidden_size"]),
                  intermediate_size=int(v["intermediate_size"]), num_heads=int(v["num_heads"]),
                  out_width=int(v["out_hidden_size"]), fullatt_block_indexes=tuple(int(i) for i in full),
                  window_size=int(v.get("window_size", 112)),
                  in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
                  patch_size=int(v.get("patch_size", 14)),
                  temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                  spatial_merge_size=int(v.get("spatial_merge_size", 2)),
                  hidden_act=v.get("hidden_act", "silu"), rope_theta=theta)
        tower.check_output_width(path, text, cfg.out_width)
        return cfg

    def __post_init__(self):
        tower.check_heads(self.embed_dim, self.num_heads, self.hidden_act)
        if self.window_groups < 1:
            raise ValueError(f"vision_config window_size {self.window_size} is smaller than one merge group "
                             f"({self.patch_size * self.spatial_merge_size} pixels)")
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(f"vision_config fullatt_block_indexes {list(self.fullatt_block_indexes)} "
                             f"name blocks outside depth {self.depth}")

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def window_groups(self) -> int:
        """A window's side in merge groups."""
        return self.window_size // self.spatial_merge_size // self.patch_size


def window_index(grids: list[Grid], merge: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The merge groups of all images in window order, and each window's length in rows.

    Returns (index [sum(t*h*w)/m^2]: the merge-window-major group that goes to each place, lengths:
    rows per non-empty window, m^2 per group). Windows run frame by frame, row-major over the
    frame's grid of windows, and inside a window its groups row-major.
    """
    index, lengths, offset = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        groups = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for f in range(t):
            for top in range(0, gh, side):
                for left in range(0, gw, side):
                    window = groups[f, top:top + side, left:left + side].flatten()
                    index.append(window + offset)
                    lengths.append(window.numel() * merge * merge)
        offset += t * gh * gw
    return torch.cat(index), lengths


class RMSNorm(nn.Module):
    """x / rms(x) in float32, rounded to x's dtype, then times the weight (transformers' order)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return self.weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        self.norm1 = RMSNorm(c.embed_dim)
        self.norm2 = RMSNorm(c.embed_dim)
        self.attn = Attention(c.embed_dim, c.num_heads)
        self.gate_proj = nn.Linear(c.embed_dim, c.intermediate_size)
        self.up_proj = nn.Linear(c.embed_dim, c.intermediate_size)
        self.down_proj = nn.Linear(c.intermediate_size, c.embed_dim)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        h = self.norm2(x)
        return x + self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


class Qwen25VLTower(nn.Module):
    """Patches of one or more images -> merged decoder rows."""

    def __init__(self, c: TowerConfig):
        super().__init__()
        self.cfg = c
        self.patch_embed = nn.Linear(c.patch_dim, c.embed_dim, bias=False)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        merged = c.embed_dim * c.spatial_merge_size ** 2
        self.ln_q = RMSNorm(c.embed_dim)
        self.mlp0 = nn.Linear(merged, merged)
        self.mlp2 = nn.Linear(merged, c.out_width)

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """patches [sum(t*h*w), patch_dim], grids pre-merge (t, h, w) -> rows [sum(t*h*w)/m^2, out_width]."""
        c, m = self.cfg, self.cfg.spatial_merge_size
        tower.check_patches(patches, grids, c.patch_dim, m)
        order, windows = window_index(grids, m, c.window_groups)
        order = order.to(patches.device)
        unit = m * m

        def regroup(x: torch.Tensor) -> torch.Tensor:
            """Rows [N, ...] in merge-window-major order -> the same rows window by window."""
            return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)

        x = regroup(self.patch_embed(patches.to(self.patch_embed.weight.dtype)))
        cos, sin = (regroup(a) for a in tower.rotary(grids, m, c.embed_dim // c.num_heads, c.rope_theta, x.device))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in c.fullatt_block_indexes else windows)
        rows = self.mlp2(F.gelu(self.mlp0(self.ln_q(x).reshape(-1, c.embed_dim * unit))))
        return rows[torch.argsort(order)]


# checkpoint name (after the visual prefix) -> our parameter name
_RENAMES = {"patch_embed.proj.weight": "patch_embed.weight", "merger.ln_q.weight": "ln_q.weight",
            "merger.mlp.0.weight": "mlp0.weight", "merger.mlp.0.bias": "mlp0.bias",
            "merger.mlp.2.weight": "mlp2.weight", "merger.mlp.2.bias": "mlp2.bias"}


def our_name(ckpt_name: str) -> str:
    """Checkpoint key under visual.* -> this module's parameter name."""
    if ckpt_name in _RENAMES:
        return _RENAMES[ckpt_name]
    return ckpt_name.replace(".mlp.", ".")


def build(cfg: TowerConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> Qwen25VLTower:
    """A tower from checkpoint tensors keyed without the visual prefix; every key must match exactly."""
    return tower.load_weights(Qwen25VLTower(cfg), tensors, our_name, dtype, device)
