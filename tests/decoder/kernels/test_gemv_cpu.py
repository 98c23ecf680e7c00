"""The few-row C++ matmul (kernels/gemv_cpu.cpp) against its torch reference, and its refusals."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels.gemv_cpu import MAX_ROWS, QBLOCK, gemv, gemv_ref, round_blocks
from services.decoder.model.quantization import quantize
from tests.tolerance import assert_close, is_close

pytestmark = pytest.mark.numerics


def weights(kind: str, n: int, k: int, g: torch.Generator):
    w = torch.randn(n, k, generator=g)
    if kind == "int8":
        return quantize(w)
    return w.to({"fp32": torch.float32, "bf16": torch.bfloat16}[kind]), None


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("n,k,bias", [(576, 576, False), (7, 13, True), (130, 1536, True), (4, 64, False)])
def test_matches_reference(kind, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, scale = weights(kind, n, k, g)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = gemv(x, w, scale, b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert_close(y, gemv_ref(x, w, scale, b), dtype=torch.float32, k=k)


def test_bf16_activations_round_once_at_the_end():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 576, generator=g).bfloat16(), torch.randn(2, 576, generator=g).bfloat16()
    y = gemv(x, w)
    assert y.dtype == torch.bfloat16
    assert_close(y, gemv_ref(x, w), dtype=torch.bfloat16, k=576)


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 3), (torch.bfloat16, 1), (torch.bfloat16, 3)])
def test_each_row_is_independent_of_the_thread_count_bit_for_bit(dtype, rows):
    """1,002 weight rows: two threads split them mid-way through a group of four (bf16, one row of x)."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(1002, 576, generator=g).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemv(x, w)
        torch.set_num_threads(max(2, threads))
        many = gemv(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    if dtype == torch.float32:       # and of the other rows (bf16: one row of x has a kernel of its own)
        assert torch.equal(gemv(x[-1:], w)[0], one[-1])


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_each_row_is_its_own_one_row_call_bit_for_bit(kind):
    """Rows past the first pass of four take each weight row again: every row's sums are still its own."""
    g = torch.Generator().manual_seed(5)
    w, scale = weights(kind, 130, 1536, g)
    x = torch.randn(MAX_ROWS, 1536, generator=g)
    alone = torch.cat([gemv(x[i:i + 1], w, scale) for i in range(MAX_ROWS)])
    for rows in range(1, MAX_ROWS + 1):
        assert torch.equal(gemv(x[:rows], w, scale), alone[:rows])


def test_round_blocks():
    """Per block of QBLOCK: steps of max|block| / 127, ties to even; an all-zero block stays zero; a
    short last block has its own scale."""
    x = torch.zeros(1, 2 * QBLOCK + 3)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 2.5, -3.5          # scale 1: 2.5 -> 2, -3.5 -> -4 (to even)
    x[0, 2 * QBLOCK:] = torch.tensor([0.3, -0.1, 0.05])    # scale 0.3 / 127
    r = round_blocks(x)
    assert r[0, :3].tolist() == [127.0, 2.0, -4.0] and not r[0, 3:QBLOCK].any()
    assert not r[0, QBLOCK:2 * QBLOCK].any()
    step = 0.3 / 127
    assert torch.allclose(r[0, 2 * QBLOCK:], torch.round(x[0, 2 * QBLOCK:] / step) * step)


def test_int8_weights_round_the_activations():
    """What the kernel computes over int8 weights is x rounded to int8 blocks: outside fp32's bound of the
    unrounded product, inside int8's (tests/tolerance.py)."""
    g = torch.Generator().manual_seed(4)
    w, scale = quantize(torch.randn(256, 576, generator=g))
    x = torch.randn(2, 576, generator=g)
    y, exact = gemv(x, w, scale), torch.nn.functional.linear(x, w.float() * scale[:, None])
    assert not is_close(y, exact, dtype=torch.float32, k=576)
    assert_close(y, exact, dtype=torch.int8, k=576)


@pytest.mark.parametrize("call, message", [
    (lambda: gemv(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8)), f"at most {MAX_ROWS} rows"),
    (lambda: gemv(torch.randn(1, 8), torch.randn(4, 9)), "x has 8 columns"),
    (lambda: gemv(torch.randn(1, 8), torch.zeros(4, 8, dtype=torch.int8)), "int8 weights need a scale"),
    (lambda: gemv(torch.randn(1, 8), torch.randn(4, 8), torch.ones(4)), "scale is for int8 weights"),
    (lambda: gemv(torch.randn(1, 8), torch.randn(4, 8).half()), "float32, bfloat16 or int8"),
    (lambda: gemv(torch.randn(1, 8), torch.randn(8, 4).t()), "contiguous"),
])
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()
