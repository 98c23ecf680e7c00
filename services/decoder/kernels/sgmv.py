"""SGMV: segmented gathered LoRA for prefill rows, grouped into one segment per adapter slot.

Rows are grouped by slot once per step (:func:`build_lora_meta`); each segment's
rows share one adapter, so a tile of BLOCK_M rows is a small GEMM against that
adapter's A and B, done with tl.dot (tensor cores on GPU).

  shrink  grid (T tiles, SPLIT_K): tile t covers sorted positions
          [tile_start, min(tile_start+BLOCK_M, tile_end)) of one segment;
          t_part[s, p, :] = x[sorted_rows[p], Ks] @ A[slot, :, Ks].T   (fp32)
  expand  grid (T tiles, cdiv(D, BLOCK_D)):
          y[sorted_rows[p], Dj] += sum_s(t_part[s, p]) @ B[slot, Dj, :].T
The grid comes from the per-step tile table, so empty segments launch nothing
and slot -1 rows are never visited (exactly zero correction).

DOT_FP32 (constexpr): cast tl.dot operands to fp32 with IEEE precision. It is
required under the interpreter (which computes bf16 tl.dot wrongly) and for fp32
inputs (otherwise the GPU would use TF32). With fp16/bf16 on GPU the operands
stay in half precision with fp32 accumulation; the shrink result is rounded to
the weight dtype before the expand dot, as torch's own half-precision F.linear
chain does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora_meta import LoraBatchMeta
from .tuning import block_r, interpreting, num_sms


@triton.jit
def _sgmv_shrink_kernel(X, A, SORTED_ROWS, TILE_START, TILE_END, TILE_SLOT, T, K, R, K_PER_SPLIT,
                        stride_xn, stride_as, stride_ar, stride_ts, stride_tp,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_FP32: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    start = tl.load(TILE_START + tile)
    end = tl.load(TILE_END + tile)
    slot = tl.load(TILE_SLOT + tile)
    p = start + tl.arange(0, BLOCK_M)
    p_mask = p < end
    rows = tl.load(SORTED_ROWS + p, mask=p_mask, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    k = tl.arange(0, BLOCK_K)
    x_rows = X + rows[:, None] * stride_xn
    # A^T tile [BLOCK_K, BLOCK_R] so tl.dot gives [BLOCK_M, BLOCK_R].
    a_slot = A + slot.to(tl.int64) * stride_as + r[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        kk = k_begin + k0 + k
        k_mask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=p_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_slot + kk[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    tl.store(T + split * stride_ts + p[:, None] * stride_tp + r[None, :], acc,
             mask=p_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(T, B, SORTED_ROWS, TILE_START, TILE_END, TILE_SLOT, Y, D, R,
                        stride_ts, stride_tp, stride_bs, stride_bd, stride_yn,
                        NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    tile = tl.program_id(0)
    pid_d = tl.program_id(1)
    start = tl.load(TILE_START + tile)
    end = tl.load(TILE_END + tile)
    slot = tl.load(TILE_SLOT + tile)
    p = start + tl.arange(0, BLOCK_M)
    p_mask = p < end
    rows = tl.load(SORTED_ROWS + p, mask=p_mask, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        t += tl.load(T + s * stride_ts + p[:, None] * stride_tp + r[None, :],
                     mask=p_mask[:, None] & r_mask[None, :], other=0.0)
    # B^T tile [BLOCK_R, BLOCK_D] so tl.dot gives [BLOCK_M, BLOCK_D].
    b = tl.load(B + slot.to(tl.int64) * stride_bs + d[None, :] * stride_bd + r[:, None],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        delta = tl.dot(t, b.to(tl.float32), input_precision="ieee")
    else:
        delta = tl.dot(t.to(b.dtype), b)
    y_ptr = Y + rows[:, None] * stride_yn + d[None, :]
    y_mask = p_mask[:, None] & d_mask[None, :]
    y = tl.load(y_ptr, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr, (y + delta).to(Y.dtype.element_ty), mask=y_mask)


def sgmv(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, meta: LoraBatchMeta,
         *, block_k: int | None = None, block_d: int | None = None, split_k: int | None = None,
         dot_fp32: bool | None = None) -> torch.Tensor:
    """Add each row's LoRA correction into y in place using the step's grouping; returns y.

    y [N, D], x [N, K], A [S, R, K], B [S, D, R]; meta from build_lora_meta(slots) for these
    N rows, on x's device. Same dtype for x, y, A, B; last dims contiguous. R is the
    padded max rank; alpha/r is folded into B. dot_fp32 None: fp32 operands under the
    interpreter or for fp32 inputs, half-precision tensor-core operands otherwise.

        for slot, start, end in meta.segments:
            rows = meta.sorted_rows[start:end]
            y[rows] = (y[rows].float() + (x[rows].float() @ A[slot].float().T) @ B[slot].float().T).to(y.dtype)
    """
    N, K = x.shape
    S, R, K_a = A.shape
    D = y.shape[1]
    if K_a != K or B.shape != (S, D, R) or y.shape[0] != N or meta.num_rows != N:
        raise ValueError(f"sgmv shapes: y {tuple(y.shape)} x {tuple(x.shape)} A {tuple(A.shape)} "
                         f"B {tuple(B.shape)} meta rows {meta.num_rows}")
    if meta.num_tiles == 0:  # every row is base only
        return y
    for name, t in (("y", y), ("x", x), ("A", A), ("B", B)):
        if t.stride(-1) != 1:
            raise ValueError(f"sgmv: {name} must be contiguous in its last dim")
    if meta.sorted_rows.device != x.device:
        raise ValueError(f"sgmv: meta is on {meta.sorted_rows.device}, tensors on {x.device}")
    if dot_fp32 is None:
        dot_fp32 = interpreting() or x.dtype == torch.float32
    BLOCK_M, BLOCK_R = meta.block_m, block_r(R)
    BLOCK_K = block_k or max(16, min(triton.next_power_of_2(K), 64 if BLOCK_M >= 64 else 128))
    BLOCK_D = block_d or max(16, min(triton.next_power_of_2(D), 128))
    k_blocks = triton.cdiv(K, BLOCK_K)
    if split_k is None:
        split_k = 1 if interpreting() else max(1, min(k_blocks, 8, (2 * num_sms(x.device)) // meta.num_tiles))
    split_k = max(1, min(split_k, k_blocks))
    k_per_split = triton.cdiv(k_blocks, split_k) * BLOCK_K
    split_k = triton.cdiv(K, k_per_split)
    # Partials indexed by sorted position: contiguous per tile.
    t = torch.empty((split_k, meta.num_adapter_rows, R), dtype=torch.float32, device=x.device)
    _sgmv_shrink_kernel[(meta.num_tiles, split_k)](
        x, A, meta.sorted_rows, meta.tile_start, meta.tile_end, meta.tile_slot, t, K, R, k_per_split,
        x.stride(0), A.stride(0), A.stride(1), t.stride(0), t.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_FP32=dot_fp32)
    _sgmv_expand_kernel[(meta.num_tiles, triton.cdiv(D, BLOCK_D))](
        t, B, meta.sorted_rows, meta.tile_start, meta.tile_end, meta.tile_slot, y, D, R,
        t.stride(0), t.stride(1), B.stride(0), B.stride(1), y.stride(0),
        NUM_SPLITS=split_k, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, DOT_FP32=dot_fp32)
    return y


def sgmv_ref(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             meta: LoraBatchMeta) -> torch.Tensor:
    """Torch truth for :func:`sgmv`, out of place, fp32 math, segment by segment: returns y + correction.

    y [N, D], x [N, K], A [S, R, K], B [S, D, R], meta for these N rows.
    """
    out = y.clone()
    rows_all = meta.sorted_rows.to(device=x.device, dtype=torch.int64)
    for slot, start, end in meta.segments:
        if end > start:
            rows = rows_all[start:end]
            delta = (x[rows].float() @ A[slot].float().T) @ B[slot].float().T
            out[rows] = (y[rows].float() + delta).to(y.dtype)
    return out
