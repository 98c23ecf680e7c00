"""Preprocessing recipes: RGB uint8 [H, W, 3] -> the pixel tensor an encoder consumes, plus its grid.

Qwen2VLRecipe mirrors transformers 5.24's `Qwen2VLImageProcessorPil` step by
step (PIL resize of uint8, float64 rescale cast to float32, float32
normalise, the same patch flattening), so its output is bit-identical; it is
our own code, because transformers is only the tests' reference.

DemoRecipe is the spec's fixed-resolution processor: resize to a square and
map [0, 255] to [-1, 1].
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from services.common.errors import InvalidArgument

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Prepared:
    """One preprocessed image.

    pixels: the encoder's input (Qwen2-VL: [grid_t*grid_h*grid_w, C*T*P*P]
    float32 patches; demo: [3, S, S]). grid: the PRE-merge patch grid
    (grid_t, grid_h, grid_w), i.e. transformers' image_grid_thw row.
    """

    pixels: torch.Tensor
    grid: tuple[int, int, int]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w) divisible by factor with h*w in [min_pixels, max_pixels], aspect kept as well as possible.

    Same arithmetic as Qwen2-VL's (Python's round-half-even included), same
    refusal of aspect ratios over 200.
    """
    if max(height, width) / min(height, width) > 200:
        raise InvalidArgument(f"absolute aspect ratio must be smaller than 200, got "
                              f"{max(height, width) / min(height, width)}", param="images")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar < factor or w_bar < factor:
        raise InvalidArgument(f"a {width}x{height} image resizes to nothing under this recipe", param="images")
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLRecipe:
    """Qwen2-VL image preprocessing; fields are those of preprocessor_config.json."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = int(Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True

    name = "qwen2_vl"

    @classmethod
    def from_folder(cls, folder: Path) -> Qwen2VLRecipe:
        """Read preprocessor_config.json as transformers does: top-level min/max_pixels win over size{}."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: a Qwen2-VL checkpoint needs its preprocessor config")
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        kw = {}
        for field_, keys in (("min_pixels", ("shortest_edge", "min_pixels")),
                             ("max_pixels", ("longest_edge", "max_pixels"))):
            for k in keys:
                if size.get(k) is not None:
                    kw[field_] = int(size[k])
                    break
            if raw.get(field_) is not None:
                kw[field_] = int(raw[field_])
        for k in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if raw.get(k) is not None:
                kw[k] = int(raw[k])
        for k in ("image_mean", "image_std"):
            if raw.get(k) is not None:
                kw[k] = tuple(float(v) for v in raw[k])
        for k in ("do_rescale", "do_normalize"):
            if raw.get(k) is not None:
                kw[k] = bool(raw[k])
        if raw.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(raw["rescale_factor"])
        for k in ("do_resize", "do_convert_rgb"):
            if raw.get(k) is False:
                raise ValueError(f"{path}: {k}=false is not supported by this recipe")
        return cls(**kw)

    def __post_init__(self):
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need 3 values (RGB)")
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1 or self.max_pixels < 1:
            raise ValueError("patch sizes and max_pixels must be positive")

    def config(self) -> dict:
        """Everything that changes the pixels: hashed into the content hash."""
        return {"recipe": self.name, **asdict(self)}

    def __call__(self, rgb: np.ndarray) -> Prepared:
        """[H, W, 3] uint8 -> patches [grid_h*grid_w, 3*T*P*P] float32, grid (1, grid_h, grid_w) pre-merge."""
        height, width = rgb.shape[:2]
        factor = self.patch_size * self.merge_size
        new_h, new_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        # transformers always resizes through PIL on uint8, even to the same size.
        image = np.array(Image.fromarray(rgb).resize((new_w, new_h), resample=self.resample))
        image = np.moveaxis(image, -1, 0)  # [3, H, W]
        if self.do_rescale:
            # Upcast first, multiply in float64, then cast: transformers' exact rounding.
            image = (image.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            image = image.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            image = (image - mean) / std
        return Prepared(torch.from_numpy(np.ascontiguousarray(self.patchify(image))), (1, *self._grid(new_h, new_w)))

    def _grid(self, height: int, width: int) -> tuple[int, int]:
        return height // self.patch_size, width // self.patch_size

    def patchify(self, image: np.ndarray) -> np.ndarray:
        """[C, H, W] -> [gh*gw, C*T*P*P].

        Rows run merge-window-major (gh/m, gw/m, m, m) so the merger can take
        each m*m group as consecutive rows; each row is (C, T, P, P) with the
        single frame repeated T times.
        """
        c, h, w = image.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = self._grid(h, w)
        x = image.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return x.reshape(gh * gw, c * t * p * p)


@dataclass(frozen=True)
class DemoRecipe:
    """The spec's fixed-resolution processor: bicubic resize to image_size^2, scale to [-1, 1]."""

    image_size: int = 16
    patch_size: int = 4

    name = "demo"

    def config(self) -> dict:
        return {"recipe": self.name, **asdict(self)}

    def __call__(self, rgb: np.ndarray) -> Prepared:
        """[H, W, 3] uint8 -> [3, S, S] float32 in [-1, 1], grid (1, S/P, S/P)."""
        s = self.image_size
        image = np.array(Image.fromarray(rgb).resize((s, s), resample=Image.Resampling.BICUBIC))
        pixels = torch.from_numpy(np.moveaxis(image, -1, 0).astype(np.float32) / 127.5 - 1.0)
        side = s // self.patch_size
        return Prepared(pixels.contiguous(), (1, side, side))
