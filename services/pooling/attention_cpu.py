"""Encoder self-attention over packed sequences on CPU: the launcher and its torch ref.

The kernel is attention_cpu.cpp next to this file, compiled once per machine by
services/common/native.py (`make kernels`). Whether it runs is decided at load by the packed
forward (packed.py), which keeps its grouped SDPA as the fallback; this module only computes.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from services.common import native

OPERATOR = native.Operator("encoder_attention_cpu", Path(__file__).with_suffix(".cpp"))
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def attention(qkv: torch.Tensor, offsets: torch.Tensor, heads: int) -> torch.Tensor:
    """qkv [T, 3 H D] (q | k | v, each head-major) of B packed sequences, offsets [B + 1] int64 (sequence
    b is tokens offsets[b]:offsets[b + 1]) -> [T, H D]: softmax(q k^T / sqrt(D)) v within each sequence.
    fp32 sums; the result in qkv's dtype (float32 or bfloat16)."""
    out = qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)
    load().attention(out, qkv.contiguous(), offsets.contiguous(), heads, (qkv.shape[1] // (3 * heads)) ** -0.5)
    return out


def attention_ref(qkv: torch.Tensor, offsets: torch.Tensor, heads: int) -> torch.Tensor:
    """The same, one sequence at a time through torch's SDPA in fp32."""
    out = qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)
    for first, last in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        if last > first:
            q, k, v = qkv[first:last].float().view(last - first, 3, heads, -1).permute(1, 2, 0, 3)
            ctx = F.scaled_dot_product_attention(q, k, v)                    # [H, L, D]
            out[first:last] = ctx.transpose(0, 1).reshape(last - first, -1).to(qkv.dtype)
    return out


if __name__ == "__main__":
    OPERATOR.main()
