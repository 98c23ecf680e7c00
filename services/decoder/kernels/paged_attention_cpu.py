"""Decode attention that reads the paged KV cache in place, on CPU: a C++ operator and its torch ref.

The kernel is paged_attention_cpu.cpp next to this file, compiled once per machine by
native.load (`make kernels` does it at install time). `paged_decode` is the launcher,
`paged_decode_ref` the plain per-row softmax it must match (tests/decoder/kernels).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from services.common import native

SOURCE = Path(__file__).with_suffix(".cpp")
OPERATOR = native.Operator("paged_attention_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float | None = None, *, rows: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row attends to that row's cached context, read from the blocks in place.

    q [N, H, D] (unit stride on D), k_cache/v_cache [NB, BS, KVH, D] contiguous, H % KVH == 0,
    block_tables [B, max_blocks] int32, context_lens [B] int32 in [1, max_blocks * BS],
    rows [B] int64 (default arange(B)): the q/out row of each table. q, caches and out share one
    dtype, float32 or bfloat16; the math is fp32 either way. Writes out [N, H, D] (default
    empty_like(q)) at `rows` only and returns it:

        G = H // KVH; scale = scale or 1 / sqrt(D)
        for b in range(B):
            r, L = rows[b], context_lens[b]
            slots = [block_tables[b, p // BS] * BS + p % BS for p in range(L)]
            K, V = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]     # [L, KVH, D]
            for h in range(H):
                p = softmax(scale * K[:, h // G].float() @ q[r, h].float())
                out[r, h] = p @ V[:, h // G].float()

    Only the first ceil(L / BS) entries of a table and the first L slots are read: unused table
    entries and cache slots may hold anything. Table entries that are read are bounds-checked.
    Runs on torch.get_num_threads() threads without the GIL. A row's result depends on its own
    inputs only, bit for bit: not on the other rows of the batch nor on the thread count.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if out is None:
        out = torch.empty_like(q)
    load().paged_decode(out, q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                        context_lens.to(torch.int32).contiguous(), rows, float(scale))
    return out


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float | None = None, *,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of paged_decode: [B, H, D] in q's dtype, row b being out[rows[b]]."""
    n_blocks, bs, kvh, d = k_cache.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = q.shape[1] // kvh
    k_flat, v_flat = k_cache.reshape(-1, kvh, d), v_cache.reshape(-1, kvh, d)
    outs = []
    for b in range(block_tables.shape[0]):
        r = b if rows is None else int(rows[b])
        length = int(context_lens[b])
        pos = torch.arange(length)
        slots = block_tables[b].long()[pos // bs] * bs + pos % bs
        k = k_flat[slots].float().repeat_interleave(g, dim=1)                  # [L, H, D]
        v = v_flat[slots].float().repeat_interleave(g, dim=1)
        p = torch.softmax(scale * torch.einsum("hd,lhd->hl", q[r].float(), k), dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(outs).to(q.dtype) if outs else q.new_empty((0, *q.shape[1:]))


if __name__ == "__main__":
    OPERATOR.main()
