"""The Qwen2-VL vision tower, written from the architecture (no transformers at run time).

patches [N, 3*T*P*P] --patch embed (Conv3d with stride == kernel, i.e. a linear)--> [N, E]
  --depth x (LayerNorm -> attention with 2D rotary, one segment per frame -> residual;
             LayerNorm -> MLP -> residual)-->
  --PatchMerger: LayerNorm, then each m*m window of consecutive rows concatenated -> MLP-->
rows [N/m^2, hidden]  (hidden = the decoder's width)

Rows arrive merge-window-major (see recipes.Qwen2VLRecipe.patchify), so the
rotary (h, w) coordinates below follow that same order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


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
        raw = json.loads(Path(path).read_text())
        v = raw.get("vision_config")
        if not isinstance(v, dict):
            raise ValueError(f"{path}: no vision_config (is this a Qwen2-VL checkpoint?)")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"{path}: vision rope_type {rope['rope_type']!r} is not supported (axial only)")
        cfg = cls(depth=int(v["depth"]), embed_dim=int(v["embed_dim"]), hidden_size=int(v["hidden_size"]),
                  num_heads=int(v["num_heads"]), mlp_ratio=float(v.get("mlp_ratio", 4)),
                  in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
                  patch_size=int(v.get("patch_size", 14)),
                  temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                  spatial_merge_size=int(v.get("spatial_merge_size", 2)),
                  hidden_act=v.get("hidden_act", "quick_gelu"), rope_theta=float(rope.get("rope_theta", 10000.0)))
        # The merger's output must be the decoder's width, or the rows cannot replace embeddings.
        text = raw.get("text_config") or raw
        if text.get("hidden_size") is not None and int(text["hidden_size"]) != cfg.hidden_size:
            raise ValueError(f"{path}: vision hidden_size {cfg.hidden_size} != text hidden_size "
                             f"{text['hidden_size']}")
        return cfg

    def __post_init__(self):
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 4:
            raise ValueError("embed_dim must split into heads whose width is a multiple of 4 (2D rotary)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported ({sorted(ACTIVATIONS)})")

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Block(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        hidden = int(c.embed_dim * c.mlp_ratio)
        self.heads = c.num_heads
        self.norm1 = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.qkv = nn.Linear(c.embed_dim, 3 * c.embed_dim)
        self.proj = nn.Linear(c.embed_dim, c.embed_dim)
        self.fc1 = nn.Linear(c.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, c.embed_dim)
        self.act = ACTIVATIONS[c.hidden_act]

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [N, E]; cos/sin [N, head_dim]; lengths: rows per segment (frames never attend to each other)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).unbind(1)  # each [N, H, D]
        dtype = q.dtype
        # Rotary in float32 whatever the compute dtype, as the reference does.
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + rotate_half(q.float()) * s).to(dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(dtype)
        outs = [F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
                for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))

    def forward(self, x, cos, sin, lengths):
        x = x + self.attention(self.norm1(x), cos, sin, lengths)
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

    def positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[N, 2] (h, w) patch coordinates in merge-window-major order, repeated per frame."""
        m = self.cfg.spatial_merge_size
        out = []
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            block = (h // m, m, w // m, m)
            hw = torch.stack([hh.reshape(block).transpose(1, 2).flatten(),
                              ww.reshape(block).transpose(1, 2).flatten()], dim=-1)
            out.append(hw.repeat(t, 1))
        return torch.cat(out)

    def rotary(self, grids) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim]: the first half rotates by h, the second by w, then repeated."""
        # Computed here in float32, not kept as a buffer that .to(bf16) would round.
        half = self.cfg.embed_dim // self.cfg.num_heads // 2
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        freqs = self.positions(grids)[..., None].float() * inv_freq  # [N, 2, head_dim/4]
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        device = self.patch_embed.weight.device
        return angles.cos().to(device), angles.sin().to(device)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [sum(t*h*w), patch_dim], grids pre-merge (t, h, w) -> rows [sum(t*h*w)/m^2, hidden]."""
        m = self.cfg.spatial_merge_size
        if patches.ndim != 2 or patches.shape[1] != self.cfg.patch_dim:
            raise ValueError(f"patches must be [N, {self.cfg.patch_dim}], got {list(patches.shape)}")
        if sum(t * h * w for t, h, w in grids) != patches.shape[0] or any(h % m or w % m for _, h, w in grids):
            raise ValueError("grids do not match the patches or the merge size")
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        cos, sin = self.rotary(grids)
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
    return (ckpt_name.replace(".attn.qkv.", ".qkv.").replace(".attn.proj.", ".proj.")
            .replace(".mlp.fc1.", ".fc1.").replace(".mlp.fc2.", ".fc2."))


def build(cfg: TowerConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> Qwen2VLTower:
    """A tower from checkpoint tensors keyed without the visual prefix; every key must match exactly."""
    tower = Qwen2VLTower(cfg)
    state = {}
    for name, tensor in tensors.items():
        if name == "patch_embed.proj.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)  # Conv3d [E, C, T, P, P] == linear over (C, T, P, P)
        state[our_name(name)] = tensor
    expected = set(tower.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"vision weights do not match the config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    tower.load_state_dict(state, strict=True)
    return tower.to(device=device, dtype=dtype).eval()
