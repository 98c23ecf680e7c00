"""Shared builders for the LoRA kernel tests: tiny adapters with real (unpadded) ranks."""
from __future__ import annotations

import torch

# Block sizes that force several K/D loop iterations and masked tails on tiny widths.
K, D = 37, 29
BLOCKS = {"block_k": 16, "block_d": 16}

# Accumulation shape for tests/tolerance.py: y + B (A x) is two stacked products, the longer of
# length K (the rank is at most 16). The interpreter rounds bf16 stores toward zero, one ulp
# (2 u); the per-layer storage term covers it.
SHAPE = {"k": K, "depth": 2}


def adapters(ranks: list[int], max_rank: int, k: int = K, d: int = D, dtype=torch.float32, seed: int = 0):
    """A [S, max_rank, k], B [S, d, max_rank] with adapter s of true rank ranks[s], zero-padded above it.

    Values are scaled so y and the correction are O(1) in every dtype.
    """
    g = torch.Generator().manual_seed(seed)
    S = len(ranks)
    A = torch.zeros(S, max_rank, k)
    B = torch.zeros(S, d, max_rank)
    for s, r in enumerate(ranks):
        A[s, :r] = torch.randn(r, k, generator=g) / k ** 0.5
        B[s, :, :r] = torch.randn(d, r, generator=g) / r ** 0.5
    return A.to(dtype), B.to(dtype)


def inputs(n: int, k: int = K, d: int = D, dtype=torch.float32, seed: int = 1):
    """x [n, k], y [n, d] (y stands for the base projection's output)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(dtype), torch.randn(n, d, generator=g).to(dtype)


def truth(y, x, A, B, slots, ranks=None):
    """Independent fp64 truth: y + B[s][:, :r] @ (A[s][:r] @ x) per row, using only the true ranks."""
    out = y.double().clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            r = A.shape[1] if ranks is None else ranks[s]
            out[i] += B[s, :, :r].double() @ (A[s, :r].double() @ x[i].double())
    return out
