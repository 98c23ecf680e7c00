"""M-RoPE positions and image rows through the runner, with fake placed images (no vision model)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from services.common.errors import InvalidArgument
from services.decoder.engine.step import PlacedImages, StepInput
from services.decoder.runner import Runner
from tests.decoder.model.checkpoints import TINY_SHAPE, build
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close, is_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

BLOCK = 4
SECTIONS = [1, 1, 2]        # the qwen2 case has head_dim 8: four rotary pairs
IMAGE_AT, GRID = 3, (1, 2, 3)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("ckpt"), "qwen2_gqa2_odd_tied", seed=21)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"]["mrope_section"] = SECTIONS
    (folder / "config.json").write_text(json.dumps(raw))
    return Runner.from_folder(folder, "fp32", block_size=BLOCK, num_blocks=64)


def fake_image_prompt(hidden: int):
    """12 tokens: 3 text, a 1x2x3 image (6 rows) at 3..8, 3 text. Positions as expand_images makes them."""
    tokens = [7, 8, 9] + [150] * 6 + [10, 11, 12]
    axes = [(p, p, p) for p in range(3)]
    axes += [(3 + t, 3 + h, 3 + w) for t in range(GRID[0]) for h in range(GRID[1]) for w in range(GRID[2])]
    cursor = 3 + max(GRID)
    axes += [(cursor + i, cursor + i, cursor + i) for i in range(3)]
    positions = torch.tensor(axes).T.contiguous()                            # [3, 12]
    delta = int(positions.max()) + 1 - len(tokens)                           # 9 - 12 = -3
    rows = {IMAGE_AT + i: torch.randn(hidden, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    return tokens, PlacedImages(positions, delta, tuple(SECTIONS), rows)


def generate(runner: Runner, seq: Seq, chunk_sizes: list[int], decode_steps: int) -> list[torch.Tensor]:
    alloc, logits = BlockAllocator(64), []
    for size in chunk_sizes + [1] * decode_steps:
        lg, batch = runner.logits(StepInput([seq.chunk(size, alloc, BLOCK)]))
        if batch.sampled:
            logits.append(lg[0])
            seq.tokens.append(int(lg[0].argmax()))
    return logits


def test_text_mrope_with_equal_rows_is_plain_rope(runner):
    tokens = [5, 6, 7, 8, 9, 10, 11]
    plain = generate(runner, Seq("p", list(tokens)), [4, 3], 3)
    mrope = generate(runner, Seq("m", list(tokens), images=PlacedImages(torch.arange(7)[None].expand(3, -1), 0)),
                     [4, 3], 3)
    for a, b in zip(plain, mrope, strict=True):
        assert torch.equal(a, b)


def test_image_chunks_cut_through_image_and_decode_uses_delta(runner):
    model = runner.model
    tokens, placed = fake_image_prompt(model.config.hidden_size)
    whole = generate(runner, Seq("w", list(tokens), images=placed), [12], 3)
    cut = generate(runner, Seq("c", list(tokens), images=placed), [4, 3, 5], 3)   # cuts at 4 and 7
    for a, b in zip(whole, cut, strict=True):
        assert_close(a, b, **TINY_SHAPE)
    # Direct reference: embeddings with the image rows swapped in, M-RoPE prompt positions, then
    # decode positions physical + delta on all three axes; plain causal attention, no cache.
    full = tokens + [int(x.argmax()) for x in whole[:-1]]
    physical = torch.arange(len(full))
    positions = torch.cat([placed.positions, (physical[12:] + placed.delta)[None].expand(3, -1)], 1)
    with torch.no_grad():
        embeds = model.embed(torch.tensor(full))
        for pos, row in placed.rows.items():
            embeds[pos] = row

        def attend(layer, q, k, v):
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
            return out[0].transpose(0, 1)

        expected = model.logits(model(embeds, positions, attend))[11:]
    for i, got in enumerate(whole):
        assert_close(got, expected[i], **TINY_SHAPE, what=f"step {i}")
    # The rows and the coordinates both matter: dropping either changes the answer.
    no_rows = generate(runner, Seq("n", list(tokens), images=replace(placed, rows={})), [12], 1)
    # Plain positions: the physical ones on all three axes, delta 0 (the text-only case above).
    plain = replace(placed, positions=torch.arange(12)[None].expand(3, -1), delta=0)
    plain_pos = generate(runner, Seq("q", list(tokens), images=plain), [12], 1)
    assert not is_close(no_rows[0], whole[0], **TINY_SHAPE)
    assert not is_close(plain_pos[0], whole[0], **TINY_SHAPE)


def test_mismatched_sections_are_refused(runner):
    tokens, placed = fake_image_prompt(runner.model.config.hidden_size)
    with pytest.raises(InvalidArgument, match="sections"):
        generate(runner, Seq("x", tokens, images=replace(placed, sections=(2, 1, 1))), [12], 0)
    # In a step the engine drives, only that request fails; the step's others run.
    alloc = BlockAllocator(64)
    bad, good = Seq("x", list(tokens), images=replace(placed, sections=(2, 1, 1))), Seq("y", [5, 6, 7])
    out = runner.execute(StepInput([bad.chunk(12, alloc, BLOCK), good.chunk(3, alloc, BLOCK)]))
    assert set(out.sampled) == {"y"} and set(out.failed) == {"x"} and "sections" in out.failed["x"]
