"""The few-row kernel's two loops for bf16 x over bf16 weights (kernels/gemv_bf16.h), each pinned: against
the torch reference (bf16 weights, fp32 sums, one rounding to bf16) and bit-for-bit against its own
one-row result whatever the other rows of x and the thread count."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels import gemv_cpu
from services.decoder.kernels.gemv_cpu import BF16_ROWS, MAX_ROWS, gemv, gemv_ref
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

# Odd widths take the masked tail of both loops (K % 64 and K % 32 nonzero); odd row counts leave weight
# rows over after the groups of four (interleave4's rows_dp<1>).
SHAPES = [(576, 576, False), (7, 13, True), (130, 1536, True), (4, 64, False), (1002, 97, True), (33, 577, False)]


@pytest.mark.parametrize("loop", BF16_ROWS)
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_matches_reference(loop, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    y = gemv(x, w, None, b, loop)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert_close(y, gemv_ref(x, w, None, b), dtype=torch.bfloat16, k=k)


@pytest.mark.parametrize("loop", BF16_ROWS)
@pytest.mark.parametrize("k", [576, 577])
def test_each_row_is_its_own_one_row_result_bit_for_bit(loop, k):
    """1,002 weight rows (two threads split them mid-way through a group of four): every row of x, in a
    call of 1 to 4 rows on 1 or 2 threads, equals that row alone on one thread."""
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(1002, k, generator=g).bfloat16(), torch.randn(MAX_ROWS, k, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [gemv(x[i:i + 1], w, None, None, loop)[0] for i in range(MAX_ROWS)]
        for t in (1, max(2, threads)):
            torch.set_num_threads(t)
            for rows in range(1, MAX_ROWS + 1):
                for start in range(MAX_ROWS - rows + 1):
                    y = gemv(x[start:start + rows], w, None, None, loop)
                    for i in range(rows):
                        assert torch.equal(y[i], alone[start + i]), (t, rows, start, i)
    finally:
        torch.set_num_threads(threads)


def test_the_loops_sum_in_another_order_where_the_cpu_has_the_bf16_dot_product():
    """Both loops are really run: over wide rows of large cancelling sums their bf16 results differ in
    some element where the CPU has the dot product, and are the same widening loop where it has not."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(4096, 4096, generator=g) * 64).bfloat16()
    x = torch.randn(1, 4096, generator=g).bfloat16()
    a, b = (gemv(x, w, None, None, loop) for loop in BF16_ROWS)
    assert_close(a.float(), b.float(), dtype=torch.bfloat16, k=4096)
    assert torch.equal(a, b) != gemv_cpu.load().bf16_dot()


def test_an_unknown_loop_is_refused():
    x, w = torch.randn(1, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    with pytest.raises(ValueError, match="bf16_row 'fast': expected one of rowwise, interleave4"):
        gemv(x, w, None, None, "fast")
    with pytest.raises(RuntimeError, match="bf16_row must be 0"):
        gemv_cpu.load().gemv(torch.empty(1, 4, dtype=torch.bfloat16), x, w, None, None, 2, 0, 1)
