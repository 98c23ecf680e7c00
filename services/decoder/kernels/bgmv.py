"""BGMV: batched gathered matrix-vector LoRA for decode rows, each row with its own adapter slot.

For row i with slot s_i >= 0:   y[i] += B[s_i] @ (A[s_i] @ x[i])   (fp32 accumulation)
Rows with slot -1 are base only: their y row is not touched at all, so the
correction is exactly zero.

Two kernels (the Punica/vLLM shape), because fusing them would make every
output tile recompute the whole K-long shrink:
  shrink  grid (N, SPLIT_K): program (i, s) reduces x[i, Ks] against A[s_i, :, Ks]
          into an fp32 partial t[s, i, :R]. Splitting K keeps the GPU busy when
          there are few decode rows (N=1 would otherwise be one program).
  expand  grid (N, cdiv(D, BLOCK_D)): program (i, j) sums the K-split partials
          and adds B[s_i, Dj, :] @ t[i] into y[i, Dj] in place.
Partials are written (not atomically added), so results are deterministic and no
zero-fill launch is needed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import block_r, interpreting, num_sms


@triton.jit
def _bgmv_shrink_kernel(X, A, SLOTS, T, K, R, K_PER_SPLIT,
                        stride_xn, stride_as, stride_ar, stride_ts, stride_tn,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(SLOTS + row)
    if slot >= 0:  # slot -1: base only; expand skips the row too, t is never read
        r = tl.arange(0, BLOCK_R)
        k = tl.arange(0, BLOCK_K)
        r_mask = r < R
        x_row = X + row.to(tl.int64) * stride_xn
        a_slot = A + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        k_begin = split * K_PER_SPLIT
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            kk = k_begin + k0 + k
            k_mask = kk < K
            x = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_slot + kk[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(T + split * stride_ts + row * stride_tn + r, acc, mask=r_mask)


@triton.jit
def _bgmv_expand_kernel(T, B, SLOTS, Y, D, R,
                        stride_ts, stride_tn, stride_bs, stride_bd, stride_yn,
                        NUM_SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    pid_d = tl.program_id(1)
    slot = tl.load(SLOTS + row)
    if slot >= 0:  # slot -1: leave y untouched, i.e. exactly zero correction
        r = tl.arange(0, BLOCK_R)
        r_mask = r < R
        d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < D
        t = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            t += tl.load(T + s * stride_ts + row * stride_tn + r, mask=r_mask, other=0.0)
        b = tl.load(B + slot.to(tl.int64) * stride_bs + d[:, None] * stride_bd + r[None, :],
                    mask=d_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b * t[None, :], axis=1)
        y_ptr = Y + row.to(tl.int64) * stride_yn + d
        y = tl.load(y_ptr, mask=d_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr, (y + delta).to(Y.dtype.element_ty), mask=d_mask)


def bgmv(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
         *, block_k: int | None = None, block_d: int | None = None, split_k: int | None = None) -> torch.Tensor:
    """Add each row's LoRA correction into y in place; returns y.

    y [N, D], x [N, K], A [S, R, K], B [S, D, R], slots [N] int (-1 = base only).
    x, y, A, B share one dtype (fp16/bf16/fp32) and device; the last dim of each is
    contiguous. R is the padded max rank (padded rank rows of A / columns of B are
    zero); alpha/r is already folded into B.

        for i in range(N):
            if slots[i] >= 0:
                t = A[slots[i]].float() @ x[i].float()               # [R]   shrink
                y[i] = (y[i].float() + B[slots[i]].float() @ t).to(y.dtype)  # [D] expand
    """
    N, K = x.shape
    S, R, K_a = A.shape
    D = y.shape[1]
    if K_a != K or B.shape != (S, D, R) or y.shape[0] != N or slots.shape != (N,):
        raise ValueError(f"bgmv shapes: y {tuple(y.shape)} x {tuple(x.shape)} A {tuple(A.shape)} "
                         f"B {tuple(B.shape)} slots {tuple(slots.shape)}")
    if N == 0:
        return y
    for name, t in (("y", y), ("x", x), ("A", A), ("B", B)):
        if t.stride(-1) != 1:
            raise ValueError(f"bgmv: {name} must be contiguous in its last dim")
    slots = slots.to(device=x.device, dtype=torch.int32)
    BLOCK_R = block_r(R)
    # Keep the [BLOCK_R, BLOCK_K] A tile around 4K elements of registers.
    BLOCK_K = block_k or max(16, min(triton.next_power_of_2(K), 4096 // BLOCK_R, 256))
    BLOCK_D = block_d or max(16, min(triton.next_power_of_2(D), 4096 // BLOCK_R, 256))
    k_blocks = triton.cdiv(K, BLOCK_K)
    if split_k is None:
        # Enough programs to cover the SMs ~2x when rows are few; no split under the
        # interpreter, where every program is slow python.
        split_k = 1 if interpreting() else max(1, min(k_blocks, 8, (2 * num_sms(x.device)) // N))
    split_k = max(1, min(split_k, k_blocks))
    k_per_split = triton.cdiv(k_blocks, split_k) * BLOCK_K
    split_k = triton.cdiv(K, k_per_split)
    t = torch.empty((split_k, N, R), dtype=torch.float32, device=x.device)
    _bgmv_shrink_kernel[(N, split_k)](
        x, A, slots, t, K, R, k_per_split,
        x.stride(0), A.stride(0), A.stride(1), t.stride(0), t.stride(1),
        BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    _bgmv_expand_kernel[(N, triton.cdiv(D, BLOCK_D))](
        t, B, slots, y, D, R,
        t.stride(0), t.stride(1), B.stride(0), B.stride(1), y.stride(0),
        NUM_SPLITS=split_k, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    return y


def bgmv_ref(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
    """Torch truth for :func:`bgmv`, out of place, fp32 math: returns y + correction.

    y [N, D], x [N, K], A [S, R, K], B [S, D, R], slots [N] (-1 = base only).
    """
    slots = slots.to(device=x.device, dtype=torch.int64)
    active = slots >= 0
    idx = slots.clamp(min=0)
    t = torch.einsum("nrk,nk->nr", A.float()[idx], x.float())
    delta = torch.einsum("ndr,nr->nd", B.float()[idx], t)
    out = y.clone()
    out[active] = (y[active].float() + delta[active]).to(y.dtype)
    return out
