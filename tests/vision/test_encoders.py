"""Encoders vs transformers' Qwen2-VL vision model; demo shapes; the revision and content hash."""
from __future__ import annotations

import io
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from services.vision import encoder as encoder_mod
from services.vision.encoder import content_hash
from services.vision.image import Limits, decode
from tests.tolerance import assert_close
from tests.vision.checkpoints import VISION_SHAPE

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

LIMITS = Limits(50 * 2**20, 50_000_000)


@pytest.fixture(scope="module")
def ours(qwen_ckpt):
    return encoder_mod.load(qwen_ckpt)


@pytest.fixture(scope="module")
def theirs(qwen_ckpt):
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil
    model = Qwen2VLForConditionalGeneration.from_pretrained(qwen_ckpt, dtype=torch.float32).eval()
    return model, Qwen2VLImageProcessorPil.from_pretrained(qwen_ckpt)


def reference_rows(theirs, datas):
    model, processor = theirs
    inputs = processor(images=[Image.open(io.BytesIO(d)) for d in datas], return_tensors="pt")
    with torch.no_grad():
        rows = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    return list(rows), [tuple(g) for g in inputs["image_grid_thw"].tolist()]


@pytest.mark.parametrize("names", [("astronaut.png",), ("chelsea.png", "rocket.jpg"), ("coffee.png", "astronaut.png")])
def test_tower_rows_match_transformers(ours, theirs, photos, names):
    """One image, and two images of different sizes in one forward (no attention across images)."""
    datas = [photos[n] for n in names]
    prepared = [ours.recipe(decode(d, LIMITS)) for d in datas]
    rows = ours.encode(prepared)
    ref_rows, ref_grids = reference_rows(theirs, datas)
    assert [p.grid for p in prepared] == ref_grids  # pre-merge, transformers' image_grid_thw
    for p, r, ref in zip(prepared, rows, ref_rows, strict=True):
        t, h, w = ours.merged_grid(p.grid)
        assert r.dtype == torch.float32 and r.shape == (t * h * w, ours.hidden_size) == ref.shape
        assert_close(r, ref, **VISION_SHAPE)


def test_batched_equals_single(ours, photos):
    a, b = (ours.recipe(decode(photos[n], LIMITS)) for n in ("chelsea.png", "astronaut.png"))
    both = ours.encode([a, b])
    assert_close(both[0], ours.encode([a])[0], **VISION_SHAPE, what="first image")
    assert_close(both[1], ours.encode([b])[0], **VISION_SHAPE, what="second image")


def test_bf16_is_close(qwen_ckpt, ours, photos):
    p = ours.recipe(decode(photos["coffee.png"], LIMITS))
    bf16 = encoder_mod.load(qwen_ckpt, dtype="bf16").encode([p])[0]
    assert bf16.dtype == torch.float32
    fp32 = ours.encode([p])[0]
    assert_close(bf16, fp32, dtype=torch.bfloat16, **VISION_SHAPE)  # bf16 rounding, not a different computation


def test_demo_encoder_shapes(demo_ckpt, photos):
    enc = encoder_mod.load(demo_ckpt)
    assert enc.recipe.name == "demo" and enc.merge_size == 1
    prepared = [enc.recipe(decode(photos[n], LIMITS)) for n in ("astronaut.png", "rocket.jpg")]
    rows = enc.encode(prepared)
    for p, r in zip(prepared, rows, strict=True):
        t, h, w = enc.merged_grid(p.grid)
        assert (t, h, w) == (1, 4, 4) and r.shape == (16, 64) and torch.isfinite(r).all()
    assert not torch.equal(rows[0], rows[1])


def test_content_hash_covers_bytes_config_and_weights(qwen_ckpt, ours, photos, tmp_path):
    data = photos["chelsea.png"]
    base = content_hash(data, ours.recipe.config(), ours.revision)
    assert base == content_hash(data, ours.recipe.config(), ours.revision)
    assert base != content_hash(data[:-1] + bytes([data[-1] ^ 1]), ours.recipe.config(), ours.revision)
    assert base != content_hash(data, {**ours.recipe.config(), "max_pixels": 1}, ours.revision)
    # Same config, one weight nudged: a new revision, so a new hash.
    other = tmp_path / "nudged"
    shutil.copytree(qwen_ckpt, other)
    tensors = load_file(str(other / "model.safetensors"))
    tensors["visual.merger.mlp.2.bias"] = tensors["visual.merger.mlp.2.bias"] + 1e-3
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    nudged = encoder_mod.load(other)
    assert nudged.revision != ours.revision
    assert content_hash(data, nudged.recipe.config(), nudged.revision) != base
    # The folder's name is not the revision: an identical copy hashes the same.
    same = tmp_path / "copy"
    shutil.copytree(qwen_ckpt, same)
    assert encoder_mod.load(same).revision == ours.revision


def test_mismatched_checkpoint_refused(qwen_ckpt, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(qwen_ckpt, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["visual.blocks.1.mlp.fc2.bias"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing"):
        encoder_mod.load(broken)
