"""BGMV (decode rows, one slot each) under TRITON_INTERPRET=1 against its ref and an fp64 truth."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels.bgmv import bgmv, bgmv_ref
from services.decoder.kernels.lora import grouped_lora_ref
from tests.tolerance import assert_close, is_close

from .lora_cases import BLOCKS, SHAPE, adapters, inputs, truth

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

SLOTS = torch.tensor([0, -1, 2, 1, 0, -1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [1, 8, 16])
def test_bgmv_matches_ref_over_ranks_and_dtypes(rank, dtype):
    A, B = adapters([rank] * 3, rank, dtype=dtype)
    x, y = inputs(len(SLOTS), dtype=dtype)
    out = bgmv(y.clone(), x, A, B, SLOTS, **BLOCKS)
    ref = bgmv_ref(y, x, A, B, SLOTS)
    assert out.dtype == dtype
    assert_close(out, ref, dtype=dtype, **SHAPE)
    assert_close(out, truth(y, x, A, B, SLOTS), dtype=dtype, **SHAPE)
    # The correction is real, so the comparison above could fail.
    assert not is_close(out, y, dtype=dtype, **SHAPE)    # the correction is far above rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bgmv_mixed_ranks_zero_padded(dtype):
    ranks = [1, 5, 16]
    A, B = adapters(ranks, 16, dtype=dtype)
    x, y = inputs(len(SLOTS), dtype=dtype)
    out = bgmv(y.clone(), x, A, B, SLOTS, **BLOCKS)
    assert_close(out, truth(y, x, A, B, SLOTS, ranks), dtype=dtype, **SHAPE)


def test_bgmv_base_rows_untouched_bit_for_bit():
    A, B = adapters([8, 8, 8], 8, dtype=torch.float16)
    x, y = inputs(len(SLOTS), dtype=torch.float16)
    out = bgmv(y.clone(), x, A, B, SLOTS, **BLOCKS)
    base = SLOTS < 0
    assert torch.equal(out[base], y[base])
    assert not torch.equal(out[~base], y[~base])
    all_base = torch.full((4,), -1)
    y4 = y[:4].clone()
    assert torch.equal(bgmv(y4.clone(), x[:4], A, B, all_base, **BLOCKS), y4)


def test_bgmv_adds_in_place_into_y():
    A, B = adapters([4, 4, 4], 8)
    x, y = inputs(len(SLOTS))
    target = y.clone()
    out = bgmv(target, x, A, B, SLOTS, **BLOCKS)
    assert out is target
    assert_close(target, bgmv_ref(y, x, A, B, SLOTS), dtype=torch.float32, **SHAPE)


def test_bgmv_split_k_partials_sum():
    # split_k=3 over K=37 with 16-wide blocks: three K ranges, the last one ragged.
    A, B = adapters([16, 3, 7], 16)
    x, y = inputs(len(SLOTS))
    out = bgmv(y.clone(), x, A, B, SLOTS, split_k=3, **BLOCKS)
    assert_close(out, bgmv_ref(y, x, A, B, SLOTS), dtype=torch.float32, **SHAPE)


def test_bgmv_bf16_within_an_ulp():
    A, B = adapters([8, 8, 8], 8, dtype=torch.bfloat16)
    x, y = inputs(len(SLOTS), dtype=torch.bfloat16)
    out = bgmv(y.clone(), x, A, B, SLOTS, **BLOCKS)
    assert_close(out, bgmv_ref(y, x, A, B, SLOTS), dtype=torch.bfloat16, **SHAPE)


def test_bgmv_ref_equals_the_spec_grouped_reference():
    A, B = adapters([2, 8, 5], 8)
    x, y = inputs(len(SLOTS))
    assert_close(bgmv_ref(y, x, A, B, SLOTS), y + grouped_lora_ref(x, A, B, SLOTS), **SHAPE)


def test_bgmv_rejects_mismatched_shapes():
    A, B = adapters([4, 4], 4)
    x, y = inputs(3)
    with pytest.raises(ValueError, match="bgmv shapes"):
        bgmv(y, x, A, B.transpose(1, 2).contiguous(), torch.tensor([0, 1, -1]))
    with pytest.raises(ValueError, match="contiguous"):
        bgmv(y.t().contiguous().t(), x, A, B, torch.tensor([0, 1, -1]))
