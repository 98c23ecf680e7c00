"""Qwen2.5-VL's tower vs transformers' Qwen2_5_VL visual model on real photos; its window order; the service
picking the tower by config.json model_type and refusing others in one line."""
from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from services.vision import encoder as encoder_mod
from services.vision import qwen2_5_vl
from services.vision.image import Limits, decode
from tests.tolerance import assert_close
from tests.vision.checkpoints import VISION_SHAPE_2_5, write_qwen2_5_vl

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

LIMITS = Limits(50 * 2**20, 50_000_000)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_qwen2_5_vl(tmp_path_factory.mktemp("vision") / "tiny-qwen2.5-vl", seed=1)


@pytest.fixture(scope="module")
def ours(ckpt):
    return encoder_mod.load(ckpt)


@pytest.fixture(scope="module")
def theirs(ckpt):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, Qwen2VLImageProcessorPil.from_pretrained(ckpt)


def reference_rows(theirs, datas):
    model, processor = theirs
    inputs = processor(images=[Image.open(io.BytesIO(d)) for d in datas], return_tensors="pt")
    with torch.no_grad():
        rows = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    return list(rows), [tuple(g) for g in inputs["image_grid_thw"].tolist()]


def test_the_tower_is_picked_by_model_type(ours, ckpt):
    assert isinstance(ours.model, qwen2_5_vl.Qwen25VLTower)
    assert ours.hidden_size == 64 and ours.merge_size == 2 and ours.recipe.name == "qwen2_vl"
    cfg = ours.model.cfg
    assert cfg.fullatt_block_indexes == (1, 3) and cfg.window_groups == 4 and cfg.embed_dim == 32


@pytest.mark.parametrize("names", [("astronaut.png",), ("rocket.jpg",), ("chelsea.png", "rocket.jpg"),
                                   ("coffee.png", "astronaut.png")])
def test_tower_rows_match_transformers(ours, theirs, photos, names):
    """A square photo (whole windows), a tall one (windows cut short at the edges), and two images of
    different sizes in one forward (no attention across images)."""
    datas = [photos[n] for n in names]
    prepared = [ours.recipe(decode(d, LIMITS)) for d in datas]
    rows = ours.encode(prepared)
    ref_rows, ref_grids = reference_rows(theirs, datas)
    assert [p.grid for p in prepared] == ref_grids
    for p, r, ref in zip(prepared, rows, ref_rows, strict=True):
        t, h, w = ours.merged_grid(p.grid)
        assert r.dtype == torch.float32 and r.shape == (t * h * w, ours.hidden_size) == ref.shape
        assert_close(r, ref, **VISION_SHAPE_2_5)


@pytest.mark.parametrize("grids, window_size", [
    ([(1, 16, 16)], 112), ([(1, 12, 18)], 112), ([(1, 16, 16), (1, 12, 18), (1, 4, 6)], 112),
    ([(2, 8, 10)], 112), ([(1, 20, 14)], 56), ([(1, 6, 6)], 224),
])
def test_window_order_equals_transformers(grids, window_size):
    from transformers.vision_utils import get_vision_window_index
    want_index, want_cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2,
                                                  window_size=window_size, patch_size=14)
    index, lengths = qwen2_5_vl.window_index(grids, 2, window_size // 2 // 14)
    assert torch.equal(index, want_index)
    assert [0, *torch.tensor(lengths).cumsum(0).tolist()] == want_cu.tolist()


def test_the_windows_change_the_rows(ckpt, ours, photos, tmp_path):
    """The same weights with every block attending over the whole image give other rows: the window blocks
    are not a no-op at these sizes, so the parity above tests them."""
    folder = tmp_path / "all-full"
    shutil.copytree(ckpt, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["vision_config"]["fullatt_block_indexes"] = [0, 1, 2, 3]
    (folder / "config.json").write_text(json.dumps(raw))
    p = ours.recipe(decode(photos["astronaut.png"], LIMITS))
    a, b = ours.encode([p])[0], encoder_mod.load(folder).encode([p])[0]
    assert (a - b).abs().max() > 0.05 * a.abs().max()


def test_batched_equals_single(ours, photos):
    a, b = (ours.recipe(decode(photos[n], LIMITS)) for n in ("chelsea.png", "rocket.jpg"))
    both = ours.encode([a, b])
    assert_close(both[0], ours.encode([a])[0], **VISION_SHAPE_2_5, what="first image")
    assert_close(both[1], ours.encode([b])[0], **VISION_SHAPE_2_5, what="second image")


def test_bf16_is_close(ckpt, ours, photos):
    p = ours.recipe(decode(photos["coffee.png"], LIMITS))
    bf16 = encoder_mod.load(ckpt, dtype="bf16").encode([p])[0]
    assert bf16.dtype == torch.float32
    assert_close(bf16, ours.encode([p])[0], dtype=torch.bfloat16, **VISION_SHAPE_2_5)


def test_mismatched_checkpoint_refused(ckpt, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["visual.blocks.1.mlp.up_proj.bias"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing"):
        encoder_mod.load(broken)


def edited(ckpt, tmp_path, change) -> str:
    folder = tmp_path / "edited"
    shutil.copytree(ckpt, folder)
    raw = json.loads((folder / "config.json").read_text())
    change(raw)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("change, recipe, match", [
    (lambda r: r.update(model_type="qwen3_vl"), "auto",
     r"config.json model_type 'qwen3_vl' is not supported \(supported: qwen2_vl, qwen2_5_vl, tessera_demo_vision\)"),
    (lambda r: None, "qwen2_vl", "recipe qwen2_vl needs a qwen2_vl folder, not config.json model_type 'qwen2_5_vl'"),
    (lambda r: r["vision_config"].update(fullatt_block_indexes=[1, 4]), "auto", "fullatt_block_indexes"),
    (lambda r: r["vision_config"].update(window_size=14), "auto", "window_size 14"),
    (lambda r: r["vision_config"].update(out_hidden_size=48), "auto", "vision output width 48"),
])
def test_refusals_name_the_key(ckpt, tmp_path, change, recipe, match):
    folder = edited(ckpt, tmp_path, change)
    with pytest.raises(ValueError, match=match):
        encoder_mod.check(folder, recipe)
    with pytest.raises(ValueError, match=match):
        encoder_mod.load(folder, recipe=recipe)


def test_an_explicit_recipe_serves_its_own_model_type(ckpt):
    assert isinstance(encoder_mod.load(ckpt, recipe="qwen2_5_vl").model, qwen2_5_vl.Qwen25VLTower)
