"""How far two floating-point computations of the same function may differ: one rule for every test.

Tests compare computations that differ only in evaluation order: batched vs single rows, ours vs
the reference library, a packed vs a plain matmul, and one CPU's kernels vs another's. Which order
a GEMM uses depends on the CPU, the ISA torch and MKL/oneDNN dispatch to, and the number of rows,
so a bound fitted to the numbers one machine happens to print fails on the next. The bound here
follows from the dtype and the accumulation length instead:

- A length-k dot product in a precision with unit roundoff u is off by at most gamma_k * sum|x_i y_i|,
  gamma_k = k u / (1 - k u) (Higham, Accuracy and Stability of Numerical Algorithms, 3.1). That
  worst case assumes every rounding error has the same sign; for the blocked, vectorised sums real
  kernels use, the errors behave like independent variables and the error grows like sqrt(k) * u
  relative to the result's magnitude (Higham and Mary, "A new approach to probabilistic rounding
  error analysis", 2019). Two different orders each carry such an error.
- Every layer also rounds what it stores to the working dtype: one more u(dtype) per layer. For
  bf16/fp16 that rounding dominates, since every kernel used here accumulates them in fp32.
- A network stacks `depth` such layers (count each matmul-bearing block: a transformer layer is
  one). Errors of successive layers add; normalisation and softmax can amplify them by their
  condition number, which SAFETY covers together with the probabilistic bound's constant (about 3
  for high probability) and the factor 2 for two independent orders.

So the bound, relative to the largest magnitude of the reference, is

    rel_tol(dtype, k, depth) = SAFETY * depth * (u(dtype) + sqrt(k) * u(accumulation dtype))

and `assert_close` checks max|actual - expected| <= rel_tol * max|expected|: norm-wise, because
a dot product's error scales with its inputs, not with the (possibly cancelled) result element.

Where an invariant is exact by construction (rows with adapter slot -1 equal the base, masked keys
get probability 0, greedy tokens equal the reference's, a codec round trip) tests assert equality
and do not come here.
"""
from __future__ import annotations

import math

import torch

# Two independent orders (2), times 2 for the condition amplification of norms and softmax. The
# sqrt(k) * u term is already pessimistic for blocked kernels (their error grows with the number
# of blocks, not with k), which covers the probabilistic bound's constant. Measured on an AMD
# Zen 4 under both kernel dispatches `make test` runs (Makefile, NUMERICS_DISPATCH): the largest
# error any test saw was 0.19 of this bound in fp32 and 0.39 in bf16.
SAFETY = 4.0

# Low-precision dtypes are accumulated in fp32 by every kernel this project uses (matmuls, SDPA,
# the Triton LoRA kernels); wider dtypes accumulate in themselves. int8 stands for activations
# rounded to int8 in blocks (kernels/gemv_cpu over int8 weights), whose block sums are fp32.
_ACCUMULATE = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.int8: torch.float32}
# A value rounded to an int8 step of its block's scale max|block| / 127 is off by at most max|block|
# / 254: relative to the block's largest magnitude, as u is relative to each value's own; the
# norm-wise comparison below measures against the largest magnitude anyway.
_INT8_BLOCK_U = 1 / 254


# fp32 whose products were formed from operands split in two bf16 halves (services/common/tile_unit.py,
# --matmul-precision high): x and w each kept to about 16 bits (a half's own rounding, 2^-17 of the value) and the
# lo x lo product left out, so each product is off by up to about 3 x 2^-17 of |x w|: an error per term, as an
# accumulation's rounding is, so it enters the bound as sqrt(k) times this u, beside fp32's own.
SPLIT_PRODUCT_U = 2.0 ** -16


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of one rounding to `dtype` (int8: see _INT8_BLOCK_U)."""
    return _INT8_BLOCK_U if dtype == torch.int8 else torch.finfo(dtype).eps / 2


def rel_tol(dtype: torch.dtype, k: int, depth: int = 1, split: bool = False) -> float:
    """The relative bound for `depth` stacked layers whose dot products are `k` long, in `dtype`; split: their
    products formed from bf16 halves (SPLIT_PRODUCT_U)."""
    if k < 1 or depth < 1:
        raise ValueError(f"k and depth must be >= 1, got k={k}, depth={depth}")
    acc = unit_roundoff(_ACCUMULATE.get(dtype, dtype)) + (SPLIT_PRODUCT_U if split else 0.0)
    return SAFETY * depth * (unit_roundoff(dtype) + math.sqrt(k) * acc)


def _default_dtype(expected) -> torch.dtype:
    if isinstance(expected, torch.Tensor) and expected.is_floating_point():
        return expected.dtype
    return torch.float32


def _compare(actual, expected, dtype, k, depth, split=False) -> tuple[bool, str]:
    a = torch.as_tensor(actual).detach().double()
    e = torch.as_tensor(expected).detach().double()
    if a.shape != e.shape:
        return False, f"shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    dtype = dtype or _default_dtype(expected)
    tol = rel_tol(dtype, k, depth, split)
    scale = float(e.abs().max()) if e.numel() else 0.0
    err = float((a - e).abs().max()) if e.numel() else 0.0
    return err <= tol * scale, (f"max |diff| {err:.3g} vs {tol:.3g} x max|expected| {scale:.3g} "
                                f"({dtype}{', split products' if split else ''}, k={k}, depth={depth}; "
                                "rel_tol in tests/tolerance.py)")


def is_close(actual, expected, *, dtype: torch.dtype | None = None, k: int, depth: int = 1) -> bool:
    """Whether `assert_close` would pass: for tests that a change is larger than rounding."""
    return _compare(actual, expected, dtype, k, depth)[0]


def assert_close(actual, expected, *, dtype: torch.dtype | None = None, k: int, depth: int = 1,
                 what: str = "", split: bool = False) -> None:
    """max|actual - expected| <= rel_tol(dtype, k, depth) * max|expected|.

    actual, expected: tensors (or array-likes) of one shape. dtype: the precision the computation
    ran in (default: expected's dtype, float32 for non-tensors); k: the longest accumulation of one
    layer (a hidden or intermediate width, a context length); depth: stacked layers; split: fp32 products formed
    from bf16 halves (--matmul-precision high).
    """
    ok, detail = _compare(actual, expected, dtype, k, depth, split)
    if not ok:
        raise AssertionError(f"{what or 'values'}: {detail}")


def assert_cosine(actual, expected, *, dtype: torch.dtype | None = None, k: int, depth: int = 1,
                  what: str = "", split: bool = False) -> None:
    """Row-wise cosine(actual, expected) >= sqrt(1 - rel_tol^2).

    A relative (2-norm) error r turns a vector by an angle theta with sin(theta) <= r, so this is
    the same rule as `assert_close` for directions (embeddings compared up to their norm).
    actual, expected: [N, D] or [D].
    """
    a = torch.as_tensor(actual).detach().double().reshape(-1, torch.as_tensor(actual).shape[-1])
    e = torch.as_tensor(expected).detach().double().reshape(a.shape)
    tol = min(rel_tol(dtype or _default_dtype(expected), k, depth, split), 1.0)
    floor = math.sqrt(1 - tol * tol)
    cos = torch.nn.functional.cosine_similarity(a, e, dim=-1)
    worst = float(cos.min())
    if not worst >= floor:
        raise AssertionError(f"{what or 'vectors'}: cosine {worst:.9f} < {floor:.9f} "
                             f"({dtype}, k={k}, depth={depth}; rel_tol in tests/tolerance.py)")
