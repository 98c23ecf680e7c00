"""The few-row C++ matmul over grouped weights (kernels/gemv_grouped.h) against the torch reference (the
dequantized weight, x rounded per group as the kernel does), bit-for-bit batch and thread invariance, and its
refusals."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels import gemv_grouped_cpu
from services.decoder.kernels.gemv_grouped_cpu import LOOPS, MAX_ROWS, gemv_grouped
from services.decoder.model import grouped
from services.decoder.model.grouped import grouped_linear_ref, quantize
from tests.tolerance import assert_close, is_close

pytestmark = pytest.mark.numerics

# Odd out widths; K a multiple of the group but not of the 64-byte chunk (a masked tail of fewer groups); an odd
# count of whole chunks before a tail (448: the `pairs` loop's last whole chunk runs alone).
SHAPES = [(7, 96, True), (130, 1536, False), (33, 160, True), (64, 32, False), (9, 448, True)]


def call(x, gw, bias=None, loop=LOOPS[0]):
    return gemv_grouped(x, gw.codes, gw.scale, gw.offset, gw.bits, gw.group, bias, loop)


# Every loop, each on the CPUs that run it: the narrower ones are what CPUs without the wider run.
each_loop = pytest.mark.parametrize("loop", [
    pytest.param(loop, marks=pytest.mark.skipif(not gemv_grouped_cpu.runs(loop), reason=f"this CPU has no {loop}"))
    for loop in LOOPS])


@each_loop
@pytest.mark.parametrize("bits", grouped.BITS)
@pytest.mark.parametrize("group", grouped.GROUPS)
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_matches_reference(loop, bits, group, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k + bits + group)
    gw = quantize(torch.randn(n, k, generator=g), bits, group)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = call(x, gw, b, loop)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert_close(y, grouped_linear_ref(x, gw, b, rounded=True), dtype=torch.float32, k=k)


@pytest.mark.parametrize("bits", grouped.BITS)
@pytest.mark.parametrize("group", grouped.GROUPS)
def test_bf16_activations_round_once_at_the_end(bits, group):
    g = torch.Generator().manual_seed(bits * group)
    gw = quantize(torch.randn(96, 576, generator=g), bits, group)
    x = torch.randn(3, 576, generator=g).bfloat16()
    y = call(x, gw)
    assert y.dtype == torch.bfloat16
    assert_close(y, grouped_linear_ref(x, gw, rounded=True), dtype=torch.bfloat16, k=576)


@each_loop
@pytest.mark.parametrize("bits", grouped.BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_its_own_one_row_result_bit_for_bit(loop, bits, dtype):
    """1,002 weight rows (two threads split them): every row of x, in a call of 1 to 4 rows on 1 or 2 threads,
    equals that row alone on one thread."""
    g = torch.Generator().manual_seed(bits)
    gw = quantize(torch.randn(1002, 544, generator=g), bits, 32)
    x = torch.randn(MAX_ROWS, 544, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([call(x[i:i + 1], gw, None, loop) for i in range(MAX_ROWS)])
        torch.set_num_threads(max(2, threads))
        for rows in range(1, MAX_ROWS + 1):
            assert torch.equal(call(x[:rows], gw, None, loop), alone[:rows])
    finally:
        torch.set_num_threads(threads)


def test_rounding_x_is_what_the_reference_models():
    """The kernel's sums are x rounded per group, not x: outside fp32's bound of the unrounded product."""
    g = torch.Generator().manual_seed(4)
    gw = quantize(torch.randn(256, 576, generator=g), 4, 32)
    x = torch.randn(2, 576, generator=g)
    assert not is_close(call(x, gw), grouped_linear_ref(x, gw), dtype=torch.float32, k=576)


def test_refusals():
    gw = quantize(torch.randn(8, 64), 4, 32)
    with pytest.raises(RuntimeError, match=f"at most {MAX_ROWS} rows"):
        call(torch.randn(MAX_ROWS + 1, 64), gw)
    with pytest.raises(RuntimeError, match=r"codes must be uint8 \[N, 48\]"):
        call(torch.randn(1, 96), gw)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        gemv_grouped(torch.randn(1, 64), gw.codes, gw.scale, gw.offset, 5, 32)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        call(torch.randn(1, 64).half(), gw)
