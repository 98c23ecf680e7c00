"""M-RoPE positions and the decode delta vs transformers' Qwen2VLModel.get_rope_index
(docs/design.md, invariants 1, 2)."""
from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.model.config import ModelConfig
from services.decoder.multimodal.images import make_image
from services.decoder.multimodal.prompt import expand_images, rope_index
from tests.vision.checkpoints import token_ids

IDS = token_ids()
IMAGE, START, END = IDS["<|image_pad|>"], IDS["<|vision_start|>"], IDS["<|vision_end|>"]
HIDDEN = 64


def image(grid, seed=0):
    t, h, w = grid
    rows = torch.randn(t * h * w, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return make_image(rows, grid, f"h{seed}", HIDDEN)


def theirs(reference, ids: list[int], grids: list[tuple[int, int, int]]):
    """transformers' positions [3, T] and delta for physical ids (grids post-merge -> image_grid_thw pre-merge)."""
    merge = reference.config.vision_config.spatial_merge_size
    input_ids = torch.tensor([ids])
    thw = torch.tensor([[t, h * merge, w * merge] for t, h, w in grids]) if grids else None
    pos, delta = reference.model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
                                                image_grid_thw=thw)
    return pos[:, 0], int(delta[0, 0])


# Each case: template ids with one IMAGE per image, and the post-merge grids. Grids are non-square both
# ways, so resuming at max(h, w) (not h*w, not h or w alone) is what is tested.
CASES = {
    "image_first": ([IMAGE, 5, 6, 7], [(1, 2, 3)]),
    "framed_image_first": ([START, IMAGE, END, 40, 41], [(1, 4, 2)]),
    "two_images": ([1, 2, START, IMAGE, END, START, IMAGE, END, 9], [(1, 3, 2), (1, 2, 5)]),
    "text_between_images": ([1, START, IMAGE, END, 10, 11, 12, 13, START, IMAGE, END, 14, 15],
                            [(1, 2, 2), (1, 3, 4)]),
    "image_last": ([1, 2, 3, START, IMAGE], [(1, 3, 3)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_positions_and_delta_equal_get_rope_index(reference, vl_ckpt, name):
    ids, grids = CASES[name]
    cfg = ModelConfig.from_folder(vl_ckpt)
    images = [image(g, i) for i, g in enumerate(grids)]
    vp = expand_images(ids, images, cfg.vision, cfg.mrope_sections)
    # Expansion: each placeholder became t*h*w ids, in place; rows sit at the image's absolute positions.
    assert len(vp.token_ids) == len(ids) - len(grids) + sum(t * h * w for t, h, w in grids)
    for im, (start, end) in zip(images, vp.spans, strict=True):
        assert vp.token_ids[start:end] == [IMAGE] * (end - start) and end - start == im.num_rows
        assert all(vp.image_rows[start + k] is not None and torch.equal(vp.image_rows[start + k], im.rows[k])
                   for k in range(im.num_rows))
    assert sorted(vp.image_rows) == [p for s, e in vp.spans for p in range(s, e)]
    want_pos, want_delta = theirs(reference, vp.token_ids, grids)
    assert torch.equal(vp.positions, want_pos)
    assert vp.delta == want_delta
    # Text after the last image resumes at max(coords) + 1 and decode continues at physical + delta.
    assert vp.delta == int(vp.positions.max()) + 1 - len(vp.token_ids)


def test_text_only_prompt_is_plain_rope(reference, vl_ckpt):
    cfg = ModelConfig.from_folder(vl_ckpt)
    ids = [5, 6, START, 7, END, 8]   # framing tokens without an image are plain text
    vp = expand_images(ids, [], cfg.vision, cfg.mrope_sections)
    assert vp.token_ids == ids and vp.delta == 0 and not vp.image_rows
    assert torch.equal(vp.positions, torch.arange(len(ids))[None].expand(3, -1))
    want_pos, want_delta = theirs(reference, ids, [])
    assert torch.equal(vp.positions, want_pos) and want_delta == 0


def test_rope_index_refuses_mismatched_runs():
    with pytest.raises(InvalidArgument):
        rope_index([1, IMAGE, IMAGE, 2], IMAGE, [(1, 1, 3)])       # run of 2 for a 3-row grid
    with pytest.raises(InvalidArgument):
        rope_index([1, IMAGE, 2], IMAGE, [])                         # a placeholder without a grid
    with pytest.raises(InvalidArgument):
        rope_index([1, 2], IMAGE, [(1, 1, 1)])                       # a grid without placeholders


def test_placeholder_count_must_match_images(vl_ckpt):
    cfg = ModelConfig.from_folder(vl_ckpt)
    with pytest.raises(InvalidArgument, match="1 image placeholder.*2 image"):
        expand_images([1, IMAGE, 2], [image((1, 1, 2)), image((1, 1, 2), 1)], cfg.vision, cfg.mrope_sections)
    with pytest.raises(InvalidArgument, match="0 image placeholder"):
        expand_images([1, 2], [image((1, 1, 2))], cfg.vision, cfg.mrope_sections)
    with pytest.raises(Unsupported, match="video"):
        expand_images([1, IDS["<|video_pad|>"]], [], cfg.vision, cfg.mrope_sections)


@pytest.mark.parametrize("rows_shape, grid, content_hash, error, match", [
    ((6, HIDDEN), (1, 2, 3), "", InvalidArgument, "content_hash"),
    ((6, HIDDEN), (1, 0, 3), "h", InvalidArgument, ">= 1"),
    ((5, HIDDEN), (1, 2, 3), "h", InvalidArgument, r"shape \[5, 64\]"),
    ((6, HIDDEN + 1), (1, 2, 3), "h", InvalidArgument, "hidden size"),
    ((12, HIDDEN), (2, 2, 3), "h", Unsupported, "single-frame"),
])
def test_image_validation(rows_shape, grid, content_hash, error, match):
    with pytest.raises(error, match=match):
        make_image(torch.zeros(rows_shape), grid, content_hash, HIDDEN)


def test_non_finite_and_non_float32_rows_refused():
    bad = torch.zeros(2, HIDDEN)
    bad[1, 3] = float("nan")
    with pytest.raises(InvalidArgument, match="NaN"):
        make_image(bad, (1, 1, 2), "h", HIDDEN)
    with pytest.raises(InvalidArgument, match="float32"):
        make_image(torch.zeros(2, HIDDEN, dtype=torch.float64), (1, 1, 2), "h", HIDDEN)
