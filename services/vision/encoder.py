"""A loaded encoder: recipe + model + revision, behind one interface for the service.

    enc = load(folder, dtype="fp32", device="cpu")
    prepared = enc.recipe(rgb)                 # per image, CPU
    rows = enc.encode([prepared, ...])         # list of [t*h*w, hidden] float32 CPU, one forward
    enc.merged_grid(prepared.grid)             # the grid Encode returns (t*h*w == rows)

The revision is a sha256 over the encoder's tensors (names, dtypes, shapes,
bytes as stored), computed once at load: the content hash changes whenever the
weights do, whatever the folder is called.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from services.common import dtypes
from services.vision import demo, qwen2_5_vl, qwen2_vl
from services.vision.recipes import DemoRecipe, Prepared, Qwen2VLRecipe

log = logging.getLogger("tessera.vision.encoder")

VISUAL_PREFIXES = ("visual.", "model.visual.")
# config.json model_type -> the module of its vision tower (TowerConfig, build, and the tower class).
TOWERS = {qwen2_vl.MODEL_TYPE: qwen2_vl, qwen2_5_vl.MODEL_TYPE: qwen2_5_vl}
KINDS = (*TOWERS, demo.MODEL_TYPE)


class Recipe(Protocol):
    name: str

    def config(self) -> dict: ...

    def __call__(self, rgb) -> Prepared: ...


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over sorted (name, dtype, shape, raw bytes)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def read_tensors(folder: Path, prefixes: tuple[str, ...] = ("",)) -> dict[str, torch.Tensor]:
    """Tensors whose key starts with one of prefixes (prefix stripped), from model*.safetensors."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                prefix = next((p for p in prefixes if key.startswith(p)), None)
                if prefix is not None:
                    out[key[len(prefix):]] = f.get_tensor(key)
    return out


@dataclass
class Encoder:
    name: str
    recipe: Recipe
    model: torch.nn.Module
    revision: str
    hidden_size: int
    merge_size: int  # 1 for encoders whose patches are rows

    def merged_grid(self, grid: tuple[int, int, int]) -> tuple[int, int, int]:
        """Pre-merge patch grid -> the grid of returned rows (t, h/m, w/m)."""
        t, h, w = grid
        return t, h // self.merge_size, w // self.merge_size

    @torch.inference_mode()
    def encode(self, batch: list[Prepared]) -> list[torch.Tensor]:
        """Prepared images -> per image float32 CPU rows [t*h*w (merged), hidden], in one forward."""
        device = next(self.model.parameters()).device
        if isinstance(self.model, (qwen2_vl.Qwen2VLTower, qwen2_5_vl.Qwen25VLTower)):
            rows = self.model(torch.cat([p.pixels for p in batch]).to(device), [p.grid for p in batch])
            sizes = [t * h * w for t, h, w in (self.merged_grid(p.grid) for p in batch)]
            parts = rows.split(sizes)
        else:
            parts = self.model(torch.stack([p.pixels for p in batch]).to(device)).unbind(0)
        return [p.float().cpu().contiguous() for p in parts]


def _kind(folder: Path, recipe: str) -> str:
    """"demo" or a TOWERS key for a folder's config.json model_type (or the --recipe that names it)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json")
    model_type = json.loads(config_path.read_text()).get("model_type", "")
    if model_type == demo.MODEL_TYPE:
        model_type = "demo"
    elif model_type == "":
        model_type = qwen2_vl.MODEL_TYPE  # a bare vision folder without a model_type: Qwen2-VL's, as before
    kind = model_type if recipe == "auto" else recipe
    if kind != model_type:
        raise ValueError(f"{folder}: recipe {kind} needs a "
                         f"{demo.MODEL_TYPE if kind == 'demo' else kind} folder, not config.json model_type "
                         f"{model_type!r}")
    if kind != "demo" and kind not in TOWERS:
        raise ValueError(f"{folder}: config.json model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(KINDS)})")
    return kind


def _tower_config(folder: Path, kind: str):
    """The tower's config and the preprocessing recipe, checked against each other."""
    cfg = TOWERS[kind].TowerConfig.from_config_json(folder / "config.json")
    rec = Qwen2VLRecipe.from_folder(folder)
    if (rec.patch_size, rec.temporal_patch_size, rec.merge_size) != \
            (cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size):
        raise ValueError(f"{folder}: preprocessor patch/merge sizes do not match vision_config")
    return cfg, rec


def check(folder: str | Path, recipe: str = "auto") -> None:
    """What load refuses about a folder, without reading a weight (services/common/process.py)."""
    folder = Path(folder)
    kind = _kind(folder, recipe)
    if kind == "demo":
        demo.DemoConfig.from_config_json(folder / "config.json")
    else:
        _tower_config(folder, kind)
    if not list(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")


def load(folder: str | Path, dtype: str = "fp32", device: str = "cpu", recipe: str = "auto") -> Encoder:
    """Load a Qwen2-VL or Qwen2.5-VL checkpoint's vision tower, or a demo encoder folder (blocking)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    kind = _kind(folder, recipe)
    if kind == "demo":
        cfg = demo.DemoConfig.from_config_json(config_path)
        tensors = read_tensors(folder)
        model = demo.DemoEncoder(cfg)
        model.load_state_dict(tensors, strict=True)
        enc = Encoder(folder.resolve().name, DemoRecipe(cfg.image_size, cfg.patch_size),
                      model.to(device=device, dtype=dtypes.to_torch(dtype)).eval(), weights_digest(tensors),
                      cfg.output_width, 1)
    else:
        cfg, rec = _tower_config(folder, kind)
        tensors = read_tensors(folder, VISUAL_PREFIXES)
        if not tensors:
            raise ValueError(f"{folder}: no visual.* or model.visual.* tensors")
        model = TOWERS[kind].build(cfg, tensors, dtypes.to_torch(dtype), device)
        enc = Encoder(folder.resolve().name, rec, model, weights_digest(tensors), cfg.out_width,
                      cfg.spatial_merge_size)
    log.info("loaded %s encoder from %s: hidden %d, revision %s", kind, folder, enc.hidden_size, enc.revision[:16])
    return enc


def content_hash(data: bytes, recipe_config: dict, revision: str) -> str:
    """sha256 over the image bytes, the canonical-JSON preprocessing config and the encoder revision."""
    h = hashlib.sha256()
    for part in (json.dumps(recipe_config, sort_keys=True, separators=(",", ":")).encode(), revision.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(data)
    return h.hexdigest()
