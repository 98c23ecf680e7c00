"""build_lora_meta: the once-per-step row permutation, segment offsets and SGMV tile table."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels.lora_meta import BGMV_MAX_SEGMENT, build_lora_meta


def test_known_grouping_is_stable_and_skips_base_rows():
    slots = torch.tensor([2, -1, 0, 2, 0, -1, 2])
    m = build_lora_meta(slots, block_m=16)
    assert m.sorted_rows.tolist() == [2, 4, 0, 3, 6]          # slot 0 rows, then slot 2 rows, in row order
    assert m.seg_slots.tolist() == [0, 2]
    assert m.seg_starts.tolist() == [0, 2, 5]
    assert m.segments == ((0, 0, 2), (2, 2, 5))
    assert m.slots.tolist() == slots.tolist()
    assert (m.num_rows, m.num_adapter_rows, m.num_tiles) == (7, 5, 2)
    assert m.tile_start.tolist() == [0, 2] and m.tile_end.tolist() == [2, 5] and m.tile_slot.tolist() == [0, 2]
    assert all(t.dtype == torch.int32 for t in (m.slots, m.sorted_rows, m.seg_starts, m.tile_start))


def test_num_slots_emits_empty_segments_without_tiles():
    m = build_lora_meta([3, 3, 1], num_slots=5, block_m=16)
    assert m.seg_slots.tolist() == [0, 1, 2, 3, 4]
    assert m.seg_starts.tolist() == [0, 0, 1, 1, 3, 3]
    assert m.segments == ((0, 0, 0), (1, 0, 1), (2, 1, 1), (3, 1, 3), (4, 3, 3))
    assert m.tile_slot.tolist() == [1, 3]                     # empty segments launch nothing


def test_long_segments_split_into_block_m_tiles():
    slots = torch.tensor([1] * 40 + [0] * 16 + [2])
    m = build_lora_meta(slots, block_m=16)
    assert m.segments == ((0, 0, 16), (1, 16, 56), (2, 56, 57))
    assert m.tile_start.tolist() == [0, 16, 32, 48, 56]
    assert m.tile_end.tolist() == [16, 56, 56, 56, 57]
    assert m.tile_slot.tolist() == [0, 1, 1, 1, 2]
    assert m.decode_only is False


@pytest.mark.parametrize("n", [0, 5])
def test_base_only_batches_have_no_work(n):
    m = build_lora_meta(torch.full((n,), -1, dtype=torch.long))
    assert not m.has_adapters and m.num_tiles == 0 and m.segments == () and m.sorted_rows.numel() == 0
    assert m.seg_starts.tolist() == [0]


def test_random_grouping_is_a_sorted_permutation():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        n = int(torch.randint(0, 60, (1,), generator=g))
        slots = torch.randint(-1, 6, (n,), generator=g)
        m = build_lora_meta(slots, block_m=16)
        rows = m.sorted_rows.long()
        assert sorted(rows.tolist()) == torch.where(slots >= 0)[0].tolist()
        got = slots[rows]
        assert torch.all(got[1:] >= got[:-1])
        for slot, start, end in m.segments:
            assert end > start and torch.all(got[start:end] == slot)
        covered = sum(min(16, int(e) - int(s)) for s, e in zip(m.tile_start, m.tile_end, strict=True))
        assert covered == m.num_adapter_rows


def test_decode_only_inference_and_override():
    assert build_lora_meta(list(range(8)) * BGMV_MAX_SEGMENT).decode_only is True
    assert build_lora_meta([0] * (BGMV_MAX_SEGMENT + 1)).decode_only is False
    assert build_lora_meta([0] * 100, decode_only=True).decode_only is True
    assert build_lora_meta([0, 1], decode_only=False).decode_only is False


def test_meta_lands_on_the_requested_device():
    m = build_lora_meta([0, 1], device="meta")
    assert m.sorted_rows.device.type == "meta" and m.segments == ((0, 0, 1), (1, 1, 2))


@pytest.mark.parametrize("kwargs", [{"block_m": 8}, {"block_m": 24}])
def test_bad_block_m_is_refused(kwargs):
    with pytest.raises(ValueError, match="block_m"):
        build_lora_meta([0], **kwargs)


def test_bad_slots_are_refused():
    with pytest.raises(ValueError, match=">= -1"):
        build_lora_meta([0, -2])
    with pytest.raises(ValueError, match="out of range"):
        build_lora_meta([0, 4], num_slots=4)
