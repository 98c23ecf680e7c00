"""Preprocessing equals transformers' Qwen2VLImageProcessorPil: pixel_values and image_grid_thw."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from services.common.errors import InvalidArgument
from services.vision.image import Limits, decode
from services.vision.recipes import DemoRecipe, Qwen2VLRecipe
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

LIMITS = Limits(50 * 2**20, 50_000_000)


def reference(processor, image: Image.Image):
    out = processor(images=image, return_tensors="pt")
    return out["pixel_values"], [tuple(g) for g in out["image_grid_thw"].tolist()]


def check(recipe: Qwen2VLRecipe, processor, data: bytes):
    ours = recipe(decode(data, LIMITS))
    pixels, grids = reference(processor, Image.open(io.BytesIO(data)))
    assert [ours.grid] == grids
    assert ours.pixels.dtype == torch.float32 and ours.pixels.shape == pixels.shape
    # The same PIL resize, then rescale and normalise: a chain of 3 roundings per pixel.
    assert_close(ours.pixels, pixels, k=3)


@pytest.fixture(scope="module")
def processors(qwen_ckpt):
    from transformers import Qwen2VLImageProcessorPil
    return {"checkpoint": (Qwen2VLRecipe.from_folder(qwen_ckpt), Qwen2VLImageProcessorPil.from_pretrained(qwen_ckpt)),
            "defaults": (Qwen2VLRecipe(), Qwen2VLImageProcessorPil())}


@pytest.mark.parametrize("which", ["checkpoint", "defaults"])
def test_photos_match_transformers(processors, photos, which):
    recipe, processor = processors[which]
    for data in photos.values():
        check(recipe, processor, data)


def png(width: int, height: int, mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}[mode]
    arr = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    im = Image.fromarray(arr[..., 0] if channels == 1 else arr, mode if channels != 1 else "L")
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("size", [(1, 1), (17, 300), (500, 29), (28, 28), (55, 57), (3, 600), (200, 1)])
def test_odd_sizes_match_transformers(processors, size):
    recipe, processor = processors["checkpoint"]
    check(recipe, processor, png(*size))


@pytest.mark.parametrize("mode", ["RGBA", "L", "LA"])
def test_modes_match_transformers(processors, mode):
    """Alpha composites on white exactly as transformers' convert_to_rgb."""
    recipe, processor = processors["checkpoint"]
    check(recipe, processor, png(40, 70, mode))


def test_aspect_ratio_refused_like_transformers(processors):
    recipe, processor = processors["checkpoint"]
    data = png(201, 1)
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        reference(processor, Image.open(io.BytesIO(data)))
    with pytest.raises(InvalidArgument, match="aspect ratio must be smaller than 200"):
        recipe(decode(data, LIMITS))


def test_recipe_reads_legacy_min_max_pixels(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}')
    r = Qwen2VLRecipe.from_folder(tmp_path)
    assert (r.min_pixels, r.max_pixels) == (3136, 12845056)


def test_patch_layout_is_merge_window_major():
    """Row k of a 4x4-patch grid is patch (h, w) in (h/2, w/2, h%2, w%2) order; each row repeats its frame T times."""
    recipe = Qwen2VLRecipe(patch_size=1, merge_size=2, temporal_patch_size=2)
    image = np.arange(4 * 4, dtype=np.float32).reshape(1, 4, 4).repeat(3, 0)
    rows = recipe.patchify(image)  # [16, 3*2*1*1]
    order = [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    assert rows[:, 0].tolist() == order and (rows == rows[:, :1]).all()


def test_demo_recipe_range_and_grid():
    p = DemoRecipe(image_size=16, patch_size=4)(np.full((30, 50, 3), 255, np.uint8))
    assert p.pixels.shape == (3, 16, 16) and p.grid == (1, 4, 4)
    assert_close(p.pixels, torch.ones(3, 16, 16), k=2)
    assert DemoRecipe()(np.zeros((5, 5, 3), np.uint8)).pixels.min() == -1.0
