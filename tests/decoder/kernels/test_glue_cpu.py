"""The C++ elementwise glue (kernels/glue_cpu.cpp) against its torch references, and its refusals."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels.glue_cpu import rms_norm, rms_norm_ref, silu_mul, silu_mul_ref
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 16), (3, 37), (64, 96), (700, 160)])
def test_silu_mul_matches_torch(dtype, rows, width):
    g = torch.Generator().manual_seed(rows * width)
    gate, up = (4 * torch.randn(rows, 2 * width, generator=g)).to(dtype).chunk(2, dim=1)   # gate|up's halves
    gate[0, :3] = torch.tensor([0.0, -100.0, 100.0])         # SiLU's zero, its far tails
    # One rounding of the SiLU apart at most (its exp is within 1 ulp of torch's): k = 1.
    assert_close(silu_mul(gate, up), silu_mul_ref(gate, up), k=1, what=f"{dtype} silu*up")


def test_silu_mul_takes_separate_tensors():
    gate, up = torch.randn(8, 80), torch.randn(8, 100)[:, 10:90]     # contiguous, and rows 100 apart
    assert_close(silu_mul(gate, up), silu_mul_ref(gate, up), k=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 8), (5, 33), (300, 576)])
def test_rms_norm_with_and_without_the_residual_add(dtype, rows, width):
    g = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=g).to(dtype)
    y = torch.randn(rows, width, generator=g).to(dtype)
    w = (torch.rand(width, generator=g) + 0.5).to(dtype)
    s, out = rms_norm(x, w, 1e-6, y)
    s_ref, out_ref = rms_norm_ref(x, w, 1e-6, y)
    assert torch.equal(s, s_ref)                             # one add, one rounding: exact
    # The sum of squares runs in another order: k = width; the result is then rounded twice.
    assert_close(out, out_ref, k=width, what=f"{dtype} add+norm")
    same, alone = rms_norm(x, w, 1e-6)
    assert same is x
    assert_close(alone, rms_norm_ref(x, w, 1e-6)[1], k=width, what=f"{dtype} norm")


def test_bad_inputs_are_refused():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        silu_mul(x.half(), x.half())
    with pytest.raises(RuntimeError, match="unit column stride"):
        silu_mul(x, x.bfloat16())
    with pytest.raises(RuntimeError, match="weight must have 8"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="y must be"):
        rms_norm(x, torch.ones(8), 1e-6, torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="y must be"):
        rms_norm(x, torch.ones(8), 1e-6, torch.randn(4, 8).bfloat16())
