"""Dense weights on the tile unit (services/common/tile_unit.py, kernels/amx_gemm.h): a bf16 weight's panels, and an
fp32 weight split in bf16 halves, against their torch references, each row its own one-row result, and the
refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.common import tile_unit
from tests.tolerance import assert_close, is_close

pytestmark = pytest.mark.numerics

# AMX's tiles and bf16 products (and Linux's leave, which these kernels ask for).
AMX = {"amx_tile", "amx_bf16"} <= set(Path("/proc/cpuinfo").read_text().split())
needs_amx = pytest.mark.skipif(not AMX, reason="no tile unit on this CPU: see the availability test")
# Odd out widths (a last block of fewer rows, and fewer than a tile's), K not a multiple of 32 (a masked tail).
SHAPES = [(7, 96, True), (130, 1536, False), (33, 160, True), (64, 32, False), (33, 1552, True)]


def test_the_tile_unit_runs_exactly_where_the_cpu_has_it():
    assert tile_unit.amx() == AMX


def _case(n, k, bias, dtype):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(40, k, generator=g).to(dtype)
    return w, x, (torch.randn(n, generator=g) if bias else None)


def _rows_are_their_own(call, x, y):
    alone = torch.cat([call(x[i:i + 1]) for i in range(x.shape[0])])
    for rows in (1, 5, 16, 17, 40):
        assert torch.equal(call(x[:rows]), alone[:rows])
    assert torch.equal(y, alone)


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_panels_match_reference_and_each_row_is_its_own(dtype, n, k, bias):
    """A bf16 weight's panels against F.linear over the same bf16 values in fp32: fp32's bound (the sums' order);
    rows 1 to 40 (one and two 16-row tiles, a short last one), each its own one-row result."""
    w, x, b = _case(n, k, bias, dtype)
    w = w.bfloat16()
    panels = tile_unit.pack_panels(w)
    y = tile_unit.gemm_panels(x, panels, n, b)
    assert y.dtype == dtype and y.shape == (40, n)
    assert_close(y, F.linear(x.bfloat16().float(), w.float(), b), dtype=dtype, k=k)
    _rows_are_their_own(lambda rows: tile_unit.gemm_panels(rows, panels, n, b), x, y)


@needs_amx
@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_split_products_within_their_bound_of_float64_and_each_row_is_its_own(n, k, bias):
    """An fp32 weight split in bf16 halves against the float64 product: within the split products' bound, and
    outside bf16's own (the lo halves count: one bf16 product alone is not this close); each row its own."""
    w, x, b = _case(n, k, bias, torch.float32)
    panels = tile_unit.pack_split_panels(w)
    assert panels.numel() == 2 * tile_unit.load().panel_size(n, k)
    y = tile_unit.gemm_panels_split(x, panels, n, b)
    assert y.dtype == torch.float32 and y.shape == (40, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert_close(y, ref, dtype=torch.float32, k=k, split=True)
    # One bf16 product (hi hi only) is off by ~2^-9: well outside what the split keeps.
    hi = tile_unit.gemm_panels(x, tile_unit.pack_panels(w.bfloat16()), n, b)
    assert (y.double() - ref).abs().max() * 16 < (hi.double() - ref).abs().max()
    assert not is_close(hi, ref, dtype=torch.float32, k=k)
    _rows_are_their_own(lambda rows: tile_unit.gemm_panels_split(rows, panels, n, b), x, y)


@needs_amx
def test_refusals():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="pack_panels: a bf16"):
        tile_unit.pack_panels(w)
    with pytest.raises(ValueError, match="pack_split_panels: an fp32"):
        tile_unit.pack_split_panels(w.bfloat16())
    panels = tile_unit.pack_split_panels(w)
    with pytest.raises(RuntimeError, match="x and out must be float32"):
        tile_unit.gemm_panels_split(torch.randn(2, 64).bfloat16(), panels, 8)
    with pytest.raises(RuntimeError, match="panels must be pack_split_panels of an"):
        tile_unit.gemm_panels_split(torch.randn(2, 64), panels[:panels.numel() // 2], 8)
    with pytest.raises(RuntimeError, match="panels must be pack_panels of an"):
        tile_unit.gemm_panels(torch.randn(2, 64), panels, 8)
