"""The grouped-weight format (model/grouped.py): its byte layout by hand, round trips, quantize's error."""
from __future__ import annotations

import pytest
import torch

from services.decoder.model import grouped
from services.decoder.model.grouped import dequantize, pack, quantize, unpack_codes


def test_layout_and_dequantize_by_hand():
    """One row, two groups of 16 at 4 bits: byte j of a group holds code j (low nibble) and j + 8 (high)."""
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)     # 0..15, 0..15
    gw = pack(codes, torch.tensor([[0.5, 2.0]]), torch.tensor([[-1.0, 3.0]]), bits=4, group=16)
    assert gw.codes.shape == (1, 16) and gw.scale.dtype == torch.float16
    assert gw.codes[0, 0].item() == 0 | (8 << 4) and gw.codes[0, 7].item() == 7 | (15 << 4)
    assert gw.codes[0, 8].item() == 0 | (8 << 4)                               # the second group
    w = dequantize(gw)[0]
    assert w[:16].tolist() == [0.5 * c - 1.0 for c in range(16)]
    assert w[16:].tolist() == [2.0 * c + 3.0 for c in range(16)]


@pytest.mark.parametrize("bits", grouped.BITS)
@pytest.mark.parametrize("group", grouped.GROUPS)
def test_pack_round_trips(bits, group):
    g = torch.Generator().manual_seed(bits + group)
    codes = torch.randint(0, 1 << bits, (5, 4 * group), generator=g, dtype=torch.uint8)
    scale, offset = torch.rand(5, 4, generator=g), torch.randn(5, 4, generator=g)
    gw = pack(codes, scale, offset, bits, group)
    assert torch.equal(unpack_codes(gw), codes)
    want = codes.float().view(5, 4, group) * scale.half().float()[:, :, None] + offset.half().float()[:, :, None]
    assert torch.equal(dequantize(gw), want.view(5, -1))
    assert gw.nbytes == 5 * 4 * group * bits // 8 + 2 * 5 * 4 * 2


@pytest.mark.parametrize("bits", grouped.BITS)
@pytest.mark.parametrize("group", grouped.GROUPS)
def test_quantize_error_is_within_half_a_step(bits, group):
    """Each weight is off by at most half its group's step (plus the fp16 rounding of the offset); a
    constant group is exact."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(9, 3 * group, generator=g)
    w[0, :group] = 0.25
    gw = quantize(w, bits, group)
    err = (dequantize(gw) - w).abs().view(9, 3, group).amax(dim=2)
    step = gw.scale.float()
    assert (err <= step / 2 + gw.offset.float().abs() * 2 ** -11 + 1e-6).all()
    assert err[0, 0] == 0
    assert torch.equal(quantize(dequantize(gw), bits, group).codes, gw.codes)   # a fixed point


def test_refusals():
    with pytest.raises(ValueError, match="bits 3"):
        pack(torch.zeros(1, 32, dtype=torch.uint8), torch.ones(1, 1), torch.zeros(1, 1), 3, 32)
    with pytest.raises(ValueError, match="divide in_features 24"):
        quantize(torch.randn(2, 24), 4, 16)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 16\)"):
        pack(torch.full((1, 16), 16, dtype=torch.uint8), torch.ones(1, 1), torch.zeros(1, 1), 4, 16)
    with pytest.raises(ValueError, match="not finite"):
        pack(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 1e6), torch.zeros(1, 1), 4, 16)
