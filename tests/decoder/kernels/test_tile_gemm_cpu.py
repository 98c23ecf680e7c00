"""The bf16 panel matmul (kernels/tile_gemm_cpu.cpp) against its torch reference, and its refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.decoder.kernels import tile_gemm_cpu
from services.decoder.kernels.tile_gemm_cpu import COLS, fits, pack, tile_gemm, tile_gemm_ref
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

CPU_HAS_BF16_DOT = "avx512_bf16" in Path("/proc/cpuinfo").read_text().split()


def test_available_exactly_where_the_cpu_has_the_bf16_dot_product():
    # Not a skip: on a CPU without avx512_bf16 this is the test that runs, and the stack never asks
    # for panels there (runner/fused_decode.py checks available()).
    assert tile_gemm_cpu.available() == CPU_HAS_BF16_DOT


def test_the_panel_layout():
    w = torch.arange(2 * COLS * 6, dtype=torch.float32).reshape(2 * COLS, 6).bfloat16()
    p = pack(w)
    assert p.shape == (2, 3, COLS, 2)
    assert torch.equal(p[1, 2, 5], w[COLS + 5, 4:6])     # panel 1, pair 2, column 5
    assert torch.equal(p.permute(0, 2, 1, 3).reshape(2 * COLS, 6), w)


@pytest.mark.skipif(not CPU_HAS_BF16_DOT, reason="the kernel needs avx512_bf16; see the availability test")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("n,k,bias", [(64, 2, False), (192, 96, True), (960, 576, False), (128, 1536, True)])
def test_matches_reference(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    y = tile_gemm(x, pack(w), b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert_close(y, tile_gemm_ref(x, w, b), dtype=torch.float32, k=k)


@pytest.mark.parametrize("shape,dtype", [((96, 64), torch.bfloat16), ((64, 63), torch.bfloat16),
                                          ((64, 64), torch.float32), ((0, 64), torch.bfloat16)])
def test_refuses_weights_that_do_not_fit(shape, dtype):
    w = torch.zeros(shape, dtype=dtype)
    assert not fits(w)
    with pytest.raises(RuntimeError, match="N a multiple of 64 and K even"):
        pack(w)
