"""The panel matmul (kernels/tile_gemm_cpu.cpp) against its torch reference, and its refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.decoder.kernels import tile_gemm_cpu
from services.decoder.kernels.gemv_cpu import gemv_ref
from services.decoder.kernels.tile_gemm_cpu import COLS, fits, pack, tile_gemm
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

FLAGS = set(Path("/proc/cpuinfo").read_text().split())
# What the kernel needs per weight dtype: AVX-512, and for bf16 the bf16 dot product.
NEEDS = {torch.float32: {"avx512f"}, torch.bfloat16: {"avx512f", "avx512_bf16"}}
RUNS = {dtype: needs <= FLAGS for dtype, needs in NEEDS.items()}


@pytest.mark.parametrize("dtype", NEEDS)
def test_available_exactly_where_the_cpu_has_what_it_needs(dtype):
    # Not a skip: on a CPU without them this is the test that runs, and the decode stack never asks for
    # panels there (runner/fused_decode.py checks available()).
    assert tile_gemm_cpu.available(dtype) == RUNS[dtype]
    assert not tile_gemm_cpu.available(torch.float16)


def test_the_panel_layouts():
    w = torch.arange(2 * COLS * 6, dtype=torch.float32).reshape(2 * COLS, 6)
    p = pack(w)
    assert p.shape == (2, 6, COLS) and torch.equal(p[1, 4, 5], w[COLS + 5, 4])    # panel 1, input 4, column 5
    b = pack(w.bfloat16())
    assert b.shape == (2, 3, COLS, 2) and torch.equal(b[1, 2, 5], w[COLS + 5, 4:6].bfloat16())   # pair 2
    assert torch.equal(b.permute(0, 2, 1, 3).reshape(2 * COLS, 6), w.bfloat16())


@pytest.mark.parametrize("dtype", [d for d, runs in RUNS.items() if runs] or
                         [pytest.param(None, marks=pytest.mark.skip(reason="no AVX-512: see the availability test"))])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 13, 64])
@pytest.mark.parametrize("n,k,bias", [(64, 2, False), (192, 96, True), (960, 576, False), (128, 1536, True)])
def test_matches_reference(dtype, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    y = tile_gemm(x, pack(w), b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert_close(y, gemv_ref(x, w, None, b), dtype=torch.float32, k=k)


@pytest.mark.parametrize("dtype", [d for d, runs in RUNS.items() if runs] or
                         [pytest.param(None, marks=pytest.mark.skip(reason="no AVX-512: see the availability test"))])
def test_each_row_is_its_own_one_row_call_bit_for_bit(dtype):
    """Rows go in tiles of six, the last 1-5 in one tile of their own: a row's sums never depend on the tile."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(128, 576, generator=g).to(dtype), torch.randn(11, 576, generator=g).to(dtype)
    panels = pack(w)
    alone = torch.cat([tile_gemm(x[i:i + 1], panels) for i in range(11)])
    for rows in range(1, 12):
        assert torch.equal(tile_gemm(x[:rows], panels), alone[:rows])


@pytest.mark.parametrize("dtype", [d for d, runs in RUNS.items() if runs] or
                         [pytest.param(None, marks=pytest.mark.skip(reason="no AVX-512: see the availability test"))])
@pytest.mark.parametrize("rows", [1, 6, 7, 13, 32, 64])
@pytest.mark.parametrize("n,k", [(64, 2), (960, 576), (4096, 96), (128, 1536)])
def test_asking_for_the_next_panel_changes_no_sum(dtype, rows, n, k):
    """The next panel asked into cache (the default) or not: the same bits, with one panel or many a thread, and
    with more tiles after a panel's first than the next panel has lines to ask for."""
    g = torch.Generator().manual_seed(rows + n + k)
    w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    panels = pack(w)
    assert torch.equal(tile_gemm(x, panels, b), tile_gemm(x, panels, b, next_panel=False))


@pytest.mark.parametrize("shape,dtype", [((96, 64), torch.bfloat16), ((64, 63), torch.bfloat16),
                                          ((96, 64), torch.float32), ((64, 64), torch.float16),
                                          ((0, 64), torch.float32)])
def test_refuses_weights_that_do_not_fit(shape, dtype):
    w = torch.zeros(shape, dtype=dtype)
    assert not fits(w)
    with pytest.raises(RuntimeError, match="N a multiple of 64"):
        pack(w)


def test_an_odd_width_fits_in_fp32():
    assert fits(torch.zeros(64, 63)) and pack(torch.zeros(64, 63)).shape == (1, 63, COLS)
