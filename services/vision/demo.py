"""The spec's demo vision encoder: a small ViT with learned positions and a projector.

RGB [B, 3, S, S] --conv patch P--> [B, (S/P)^2, width] + positions
  --bidirectional pre-norm transformer layers--> LayerNorm --MLP projector--> [B, (S/P)^2, output_width]

Its folder holds config.json (model_type "tessera_demo_vision") and
model.safetensors; `save` writes one with random weights, for tests and the
local demo (random weights prove plumbing, not understanding).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

MODEL_TYPE = "tessera_demo_vision"


@dataclass(frozen=True)
class DemoConfig:
    image_size: int = 16
    patch_size: int = 4
    width: int = 32
    heads: int = 4
    layers: int = 2
    output_width: int = 64

    def __post_init__(self):
        if self.image_size % self.patch_size or self.width % self.heads:
            raise ValueError("image size must divide into patches, width into heads")

    @classmethod
    def from_config_json(cls, path: Path) -> DemoConfig:
        raw = json.loads(Path(path).read_text())
        return cls(**{k: int(raw[k]) for k in asdict(cls()) if k in raw})


class DemoEncoder(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        self.cfg = c
        self.patch = nn.Conv2d(3, c.width, c.patch_size, stride=c.patch_size)
        self.position = nn.Parameter(torch.randn((c.image_size // c.patch_size) ** 2, c.width) * 0.02)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(
            c.width, c.heads, 4 * c.width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
            for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.width)
        self.projector = nn.Sequential(nn.Linear(c.width, c.output_width), nn.GELU(),
                                       nn.Linear(c.output_width, c.output_width))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] in [-1, 1] -> [B, (S/P)^2, output_width]."""
        if tuple(pixels.shape[1:]) != (3, self.cfg.image_size, self.cfg.image_size):
            raise ValueError(f"pixels must be [B, 3, {self.cfg.image_size}, {self.cfg.image_size}]")
        x = self.patch(pixels.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2) + self.position
        for block in self.blocks:
            x = block(x)  # every patch sees every other patch of its own image
        return self.projector(self.norm(x))


def save(folder: Path, cfg: DemoConfig = DemoConfig(), seed: int = 0) -> Path:
    """Write a random-weight demo encoder folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = DemoEncoder(cfg)
    (folder / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE, **asdict(cfg),
                                                    "note": "random weights: proves plumbing only"}, indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder
