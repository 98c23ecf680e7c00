"""The Qwen2-VL vision tower, written from the architecture (no transformers at run time).

patches [N, 3*T*P*P] --patch embed (Conv3d with stride == kernel, i.e. a linear)--> [N, E]
  --depth x (LayerNorm -> attention with 2D rotary, one segment per frame -> residual;
             LayerNorm -> MLP -> residual)-->
  --PatchMerger: LayerNorm, then each m*m window of consecutive rows concatenated -> MLP-->
rows [N/m^2, hidden]  (hidden = the decoder's width)

Rows arrive merge-window-major (see recipes.Qwen2VLRecipe.patchify), so the
rotary (h, w) coordinates follow that same order. What Qwen2.5-VL's tower shares
with this one lives in tower.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.vision import tower
from services.vision.tower import ACTIVATIONS, Attention, Grid

MODEL_TYPE = "qwen2_vl"


@dataclass(frozen=True)
class TowerConfig:
    """vision_config of a Qwen2-VL config.json."""

    depth: int
    embed_dim: int
    hidden_size: int
    num_heads: int
    mlp_ratio: float = 4
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0

    @classmethod
    def from_config_json(cls, path: Path) -> TowerConfig:
        v, text, theta = tower.vision_config(path)
        cfg = cls(depth=int(v["depth"]), embed_dim=int(v["embed_dim"]), hidden_size=int(v["hidden_size"]),
                  num_heads=int(v["num_heads"]), mlp_ratio=float(v.get("mlp_ratio", 4)),
                  in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
                  patch_size=int(v.get("patch_size", 14)),
                  temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                  spatial_merge_size=int(v.get("spatial_merge_size", 2)),
                  hidden_act=v.get("hidden_act", "quick_gelu"), rope_theta=theta)
        tower.check_output_width(path, text, cfg.hidden_size)
        return cfg

    def __post_init__(self):
        tower.check_heads(self.embed_dim, self.num_heads, self.hidden_act)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def out_width(self) -> int:
        return self.hidden_size


class Block(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        hidden = int(c.embed_dim * c.mlp_ratio)
        self.norm1 = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.attn = Attention(c.embed_dim, c.num_heads)
        self.fc1 = nn.Linear(c.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, c.embed_dim)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Qwen2VLTower(nn.Module):
    """Patches of one or more images -> merged decoder rows."""

    def __init__(self, c: TowerConfig):
        super().__init__()
        self.cfg = c
        self.patch_embed = nn.Linear(c.patch_dim, c.embed_dim, bias=False)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        merged = c.embed_dim * c.spatial_merge_size ** 2
        self.ln_q = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.mlp0 = nn.Linear(merged, merged)
        self.mlp2 = nn.Linear(merged, c.hidden_size)

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """patches [sum(t*h*w), patch_dim], grids pre-merge (t, h, w) -> rows [sum(t*h*w)/m^2, hidden]."""
        m = self.cfg.spatial_merge_size
        tower.check_patches(patches, grids, self.cfg.patch_dim, m)
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        cos, sin = tower.rotary(grids, m, self.cfg.embed_dim // self.cfg.num_heads, self.cfg.rope_theta, x.device)
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        x = self.ln_q(x).reshape(-1, self.cfg.embed_dim * m * m)
        return self.mlp2(F.gelu(self.mlp0(x)))


# checkpoint name (after the visual prefix) -> our parameter name
_RENAMES = {"patch_embed.proj.weight": "patch_embed.weight", "merger.ln_q.weight": "ln_q.weight",
            "merger.ln_q.bias": "ln_q.bias", "merger.mlp.0.weight": "mlp0.weight",
            "merger.mlp.0.bias": "mlp0.bias", "merger.mlp.2.weight": "mlp2.weight", "merger.mlp.2.bias": "mlp2.bias"}


def our_name(ckpt_name: str) -> str:
    """Checkpoint key under visual.* -> this module's parameter name."""
    if ckpt_name in _RENAMES:
        return _RENAMES[ckpt_name]
    return ckpt_name.replace(".mlp.fc1.", ".fc1.").replace(".mlp.fc2.", ".fc2.")


def build(cfg: TowerConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> Qwen2VLTower:
    """A tower from checkpoint tensors keyed without the visual prefix; every key must match exactly."""
    return tower.load_weights(Qwen2VLTower(cfg), tensors, our_name, dtype, device)
