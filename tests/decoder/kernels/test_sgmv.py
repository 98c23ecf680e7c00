"""SGMV (rows grouped into per-slot segments, tiled tl.dot) under TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels.lora_meta import build_lora_meta
from services.decoder.kernels.sgmv import sgmv, sgmv_ref
from tests.tolerance import assert_close, is_close

from .lora_cases import BLOCKS, SHAPE, adapters, inputs, truth

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

# Slot 0: 20 rows (two 16-row tiles, the second ragged), slot 1: none (length 0),
# slot 2: one row, slot 3: 5 rows, plus base-only rows; shuffled like a real step.
_PLAN = [0] * 20 + [2] + [3] * 5 + [-1] * 3
SLOTS = torch.tensor(_PLAN)[torch.randperm(len(_PLAN), generator=torch.Generator().manual_seed(0))]


def _meta(slots=SLOTS, **kw):
    return build_lora_meta(slots, num_slots=4, block_m=16, decode_only=False, **kw)


def test_plan_covers_segment_lengths_zero_one_and_many():
    lengths = {slot: end - start for slot, start, end in _meta().segments}
    assert lengths == {0: 20, 1: 0, 2: 1, 3: 5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [1, 8, 16])
def test_sgmv_matches_ref_over_ranks_and_dtypes(rank, dtype):
    A, B = adapters([rank] * 4, rank, dtype=dtype)
    x, y = inputs(len(SLOTS), dtype=dtype)
    meta = _meta()
    out = sgmv(y.clone(), x, A, B, meta, **BLOCKS)
    assert_close(out, sgmv_ref(y, x, A, B, meta), dtype=dtype, **SHAPE)
    assert_close(out, truth(y, x, A, B, SLOTS), dtype=dtype, **SHAPE)
    assert not is_close(out, y, dtype=dtype, **SHAPE)    # the correction is far above rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sgmv_mixed_ranks_zero_padded(dtype):
    ranks = [16, 3, 1, 9]
    A, B = adapters(ranks, 16, dtype=dtype)
    x, y = inputs(len(SLOTS), dtype=dtype)
    out = sgmv(y.clone(), x, A, B, _meta(), **BLOCKS)
    assert_close(out, truth(y, x, A, B, SLOTS, ranks), dtype=dtype, **SHAPE)


def test_sgmv_half_precision_dot_operands():
    # The GPU fast path (fp16 tl.dot operands, fp32 accumulate, shrink result rounded to fp16).
    A, B = adapters([8] * 4, 8, dtype=torch.float16)
    x, y = inputs(len(SLOTS), dtype=torch.float16)
    meta = _meta()
    out = sgmv(y.clone(), x, A, B, meta, dot_fp32=False, **BLOCKS)
    assert_close(out, sgmv_ref(y, x, A, B, meta), dtype=torch.float16, **SHAPE)


def test_sgmv_base_rows_untouched_and_in_place():
    A, B = adapters([8] * 4, 8, dtype=torch.float16)
    x, y = inputs(len(SLOTS), dtype=torch.float16)
    target = y.clone()
    assert sgmv(target, x, A, B, _meta(), **BLOCKS) is target
    base = SLOTS < 0
    assert torch.equal(target[base], y[base]) and not torch.equal(target[~base], y[~base])


def test_sgmv_all_base_and_empty_batches_launch_nothing():
    A, B = adapters([4] * 4, 4)
    x, y = inputs(3)
    meta = _meta(torch.full((3,), -1))
    assert meta.num_tiles == 0
    assert torch.equal(sgmv(y.clone(), x, A, B, meta), y)
    x0, y0 = inputs(0)
    assert sgmv(y0, x0, A, B, _meta(torch.zeros(0, dtype=torch.long))).shape == (0, y.shape[1])


def test_sgmv_split_k_and_wide_tiles():
    A, B = adapters([16, 2, 7, 11], 16)
    x, y = inputs(len(SLOTS))
    meta = build_lora_meta(SLOTS, block_m=32, decode_only=False)
    out = sgmv(y.clone(), x, A, B, meta, split_k=3, **BLOCKS)
    assert_close(out, sgmv_ref(y, x, A, B, meta), dtype=torch.float32, **SHAPE)


def test_sgmv_bf16_within_an_ulp():
    A, B = adapters([8] * 4, 8, dtype=torch.bfloat16)
    x, y = inputs(len(SLOTS), dtype=torch.bfloat16)
    meta = _meta()
    assert_close(sgmv(y.clone(), x, A, B, meta, **BLOCKS), sgmv_ref(y, x, A, B, meta),
                 dtype=torch.bfloat16, **SHAPE)


def test_sgmv_one_meta_serves_every_projection():
    # The same per-step meta drives projections of different widths (q: K->D, up: K->2D).
    meta = _meta()
    x, _ = inputs(len(SLOTS))
    for k_in, d_out, seed in ((37, 29, 0), (37, 58, 1), (29, 37, 2)):
        A, B = adapters([8, 8, 4, 2], 8, k=k_in, d=d_out, seed=seed)
        xx, y = inputs(len(SLOTS), k=k_in, d=d_out, seed=seed + 10)
        out = sgmv(y.clone(), xx, A, B, meta, **BLOCKS)
        assert_close(out, truth(y, xx, A, B, SLOTS), dtype=torch.float32, **SHAPE)


def test_sgmv_rejects_meta_for_other_rows():
    A, B = adapters([4] * 4, 4)
    x, y = inputs(5)
    with pytest.raises(ValueError, match="meta rows"):
        sgmv(y, x, A, B, _meta())
