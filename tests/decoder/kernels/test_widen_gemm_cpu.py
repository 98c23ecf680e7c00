"""The many-row C++ matmul over grouped and int8 weights, on AVX-512 dot products and on the tile unit, and
grouped weights' dequantization (kernels/widen_gemm.h, services/common/kernels/amx_gemm.h), against the torch
references (the dequantized weight; F.linear over it), bit-for-bit batch and thread invariance, and their
refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.decoder.kernels import gemv_grouped_cpu, widen_gemm_cpu
from services.decoder.kernels.widen_gemm_cpu import gemm_grouped
from services.decoder.model import grouped, quantization
from services.decoder.model.grouped import quantize
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

FLAGS = set(Path("/proc/cpuinfo").read_text().split())
# What the matmul needs per products' dtype: AVX-512 or AVX2 with FMA, and for bf16 the bf16 dot product.
NEEDS = {torch.float32: ({"avx512f"}, {"avx2", "fma"}), torch.bfloat16: ({"avx512f", "avx512_bf16"},)}
RUNS = {dtype: any(needs <= FLAGS for needs in options) for dtype, options in NEEDS.items()}
# The tile unit's kernel needs AMX's tiles and bf16 products (and Linux's leave, which these kernels have).
AMX = {"amx_tile", "amx_bf16"} <= FLAGS
# (x's dtype, the products', the kernel): every triple the module computes, each where this CPU runs it.
PAIRS = [(torch.float32, torch.float32, "dot"), (torch.float32, torch.bfloat16, "dot"),
         (torch.bfloat16, torch.bfloat16, "dot"), (torch.float32, torch.bfloat16, "amx"),
         (torch.bfloat16, torch.bfloat16, "amx")]
each_pair = pytest.mark.parametrize("dtype,products,kernel", [
    pytest.param(d, p, kn, marks=pytest.mark.skipif(not (AMX if kn == "amx" else RUNS[p]),
                                                    reason=f"no {p} products on this CPU's {kn} kernel: see the "
                                                    "availability test")) for d, p, kn in PAIRS])
# Odd out widths (a last block of fewer rows, and fewer than a tile's). Groups of 16 take K + 16: a multiple of
# the group but not of a bf16 vector's 32 inputs (a masked tail).
SHAPES = [(7, 96, True), (130, 1536, False), (33, 160, True), (64, 32, False)]


def call(x, gw, bias=None, products=None, kernel="dot"):
    return gemm_grouped(x, gw.codes, gw.scale, gw.offset, gw.bits, gw.group, bias, products, kernel)


@pytest.mark.parametrize("products", NEEDS)
def test_runs_exactly_where_the_cpu_has_what_it_needs(products):
    # Not a skip: on a CPU without them this is the test that runs, and the load-time choice never offers the
    # path there (model/matmul_choice.grouped_paths).
    assert widen_gemm_cpu.runs(products) == RUNS[products]
    bf16 = torch.bfloat16 if RUNS[torch.bfloat16] else None
    expected = {torch.bfloat16: bf16, torch.float32: bf16 or (torch.float32 if RUNS[torch.float32] else None)}
    assert {d: widen_gemm_cpu.products_for(d) for d in expected} == expected
    assert not widen_gemm_cpu.available(torch.float16)


def test_the_tile_unit_runs_exactly_where_the_cpu_has_it():
    assert widen_gemm_cpu.amx() == AMX
    assert ("amx" in quantization.usable_gemms(torch.float32)) == AMX


@pytest.mark.parametrize("dtype", widen_gemm_cpu.DTYPES)
@pytest.mark.parametrize("bits", grouped.BITS)
@pytest.mark.parametrize("group", grouped.GROUPS)
def test_dequantize_is_the_reference_bit_for_bit(dtype, bits, group):
    g = torch.Generator().manual_seed(bits + group)
    gw = quantize(torch.randn(37, 1536 + (16 if group == 16 else 0), generator=g) * 3, bits, group)
    ref = gemv_grouped_cpu.dequantize(gw.codes, gw.scale, gw.offset, bits, group).to(dtype)
    got = widen_gemm_cpu.dequantize(gw.codes, gw.scale, gw.offset, bits, group, dtype)
    assert got.dtype == dtype and torch.equal(got, ref)
    assert torch.equal(grouped.expand(gw, dtype), ref)


@each_pair
@pytest.mark.parametrize("bits", grouped.BITS)
@pytest.mark.parametrize("group", grouped.GROUPS)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_matches_reference(dtype, products, kernel, bits, group, rows, n, k, bias):
    """Against F.linear over the same products (x and the dequantized weight in `products`): fp32's bound, the
    sums' order alone; against the exact fp32 reference: the products' dtype's bound."""
    k += 16 if group == 16 else 0
    g = torch.Generator().manual_seed(rows * 1000 + n + k + bits + group)
    gw = quantize(torch.randn(n, k, generator=g), bits, group)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    y = call(x, gw, b, products, kernel)
    assert y.dtype == dtype and y.shape == (rows, n)
    same = widen_gemm_cpu.gemm_ref(x, gw.codes, gw.scale, gw.offset, bits, group, b, products)
    assert_close(y, same, dtype=dtype, k=k)
    assert_close(y, grouped.grouped_linear_ref(x, gw, b), dtype=products, k=k)


@each_pair
@pytest.mark.parametrize("bits", grouped.BITS)
def test_each_row_is_its_own_one_row_result_bit_for_bit(dtype, products, kernel, bits):
    """100 weight rows (four blocks; two threads split them): every row of x, in a call of 1 to 40 rows (the tile
    unit's 16-row tiles, one and two at a time) on 1 or 2 threads, equals that row alone on one thread."""
    g = torch.Generator().manual_seed(bits)
    gw = quantize(torch.randn(100, 544, generator=g), bits, 32)
    x = torch.randn(40, 544, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([call(x[i:i + 1], gw, None, products, kernel) for i in range(40)])
        torch.set_num_threads(max(2, threads))
        for rows in (2, 6, 7, 13, 40):
            assert torch.equal(call(x[:rows], gw, None, products, kernel), alone[:rows])
    finally:
        torch.set_num_threads(threads)


@each_pair
@pytest.mark.parametrize("rows", [1, 7, 13, 40])
@pytest.mark.parametrize("n,k,bias", [(7, 96, True), (130, 1552, False), (33, 16, True)])
def test_int8_matches_reference(dtype, products, kernel, rows, n, k, bias):
    """Against F.linear over the codes in `products` with x there too, times the scales: fp32's bound (the sums'
    order); against the dequantized fp32 reference: the products' bound."""
    g = torch.Generator().manual_seed(rows + n + k)
    q, scale = quantization.quantize(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    y = widen_gemm_cpu.gemm_int8(x, q, scale, b, products, kernel)
    assert y.dtype == dtype and y.shape == (rows, n)
    same = widen_gemm_cpu.gemm_ref(x, q, scale, None, 0, 0, b, products)
    assert_close(y, same, dtype=dtype, k=k)
    assert_close(y, quantization.int8_linear_ref(x, q, scale, b), dtype=products, k=k)
    one = torch.cat([widen_gemm_cpu.gemm_int8(x[i:i + 1], q, scale, b, products, kernel) for i in range(rows)])
    assert torch.equal(y, one)


def test_refusals():
    gw = quantize(torch.randn(8, 64), 4, 32)
    # The module's own checks, reached directly: through gemm_grouped a CPU without AVX-512 refuses first (no kernel).
    raw = widen_gemm_cpu.load().gemm_grouped
    with pytest.raises(RuntimeError, match=r"x must be a contiguous \[M, 64\]"):
        raw(torch.empty(1, 8), torch.randn(1, 96), gw.codes, gw.scale, gw.offset, 4, 32, None, False, False)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        raw(torch.empty(1, 8), torch.randn(1, 64), gw.codes, gw.scale, gw.offset, 5, 32, None, False, False)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        raw(torch.empty(1, 8), torch.randn(1, 64).half(), gw.codes, gw.scale, gw.offset, 4, 32, None, False, False)
    with pytest.raises(RuntimeError, match=r"scale and offset must be float16 \[N, 2\]"):
        raw(torch.empty(1, 8), torch.randn(1, 64), gw.codes, gw.scale.float(), gw.offset, 4, 32, None, False, False)
    with pytest.raises(ValueError, match="widen_gemm: no kernel here for torch.bfloat16 x"):
        call(torch.randn(1, 64).bfloat16(), gw, None, torch.float32)
    with pytest.raises(RuntimeError, match=r"gemm_int8: scale must be float32 \[8\]"):
        widen_gemm_cpu.load().gemm_int8(torch.empty(1, 8), torch.randn(1, 64), torch.zeros(8, 64, dtype=torch.int8),
                                        torch.ones(4), None, False, False)
    with pytest.raises(ValueError, match="kernel 'vnni': expected one of dot, amx"):
        call(torch.randn(1, 64), gw, None, None, "vnni")
    with pytest.raises(ValueError, match="no tile-unit kernel here for torch.float32 x .products torch.float32"):
        call(torch.randn(1, 64), gw, None, torch.float32, "amx")
    with pytest.raises(RuntimeError, match="the tile unit multiplies in bf16"):
        raw(torch.empty(1, 8), torch.randn(1, 64), gw.codes, gw.scale, gw.offset, 4, 32, None, False, True)
    with pytest.raises(ValueError, match="dtype torch.float16"):
        widen_gemm_cpu.dequantize(gw.codes, gw.scale, gw.offset, 4, 32, torch.float16)
