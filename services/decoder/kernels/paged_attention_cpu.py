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
                 out: torch.Tensor | None = None, first_keys: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """One query token per row attends to that row's cached context, read from the blocks in place.

    q [N, H, D] (unit stride on D), k_cache/v_cache [NB, BS, KVH, D] contiguous, H % KVH == 0,
    block_tables [B, max_blocks] int32, context_lens [B] int32 in [1, max_blocks * BS],
    rows [B] int64 (default arange(B)): the q/out row of each table; first_keys [B] int32 in
    [0, context_lens) (default 0): a row's first key (a sliding window); softcap (default none): scores
    become softcap * tanh(scores / softcap) before the softmax. q, caches and out share one
    dtype, float32 or bfloat16; the math is fp32 either way. Writes out [N, H, D] (default
    empty_like(q)) at `rows` only and returns it:

        G = H // KVH; scale = scale or 1 / sqrt(D)
        for b in range(B):
            r, L, F = rows[b], context_lens[b], first_keys[b]
            slots = [block_tables[b, p // BS] * BS + p % BS for p in range(F, L)]
            K, V = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]     # [L, KVH, D]
            for h in range(H):
                s = scale * K[:, h // G].float() @ q[r, h].float()
                p = softmax(softcap * tanh(s / softcap) if softcap else s)
                out[r, h] = p @ V[:, h // G].float()

    Only the table entries F // BS .. ceil(L / BS) - 1 and the slots F .. L - 1 are read: other table
    entries (a freed block's placeholder) and cache slots may hold anything. Table entries that are
    read are bounds-checked.
    Runs on torch.get_num_threads() threads without the GIL. A row's result depends on its own
    inputs only, bit for bit: not on the other rows of the batch nor on the thread count.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if out is None:
        out = torch.empty_like(q)
    if first_keys is not None:
        first_keys = first_keys.to(torch.int32).contiguous()
    load().paged_decode(out, q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                        context_lens.to(torch.int32).contiguous(), rows, float(scale), first_keys,
                        float(softcap or 0.0))
    return out


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float | None = None, *,
                     rows: torch.Tensor | None = None, first_keys: torch.Tensor | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """The torch reference of paged_decode: [B, H, D] in q's dtype, row b being out[rows[b]]."""
    n_blocks, bs, kvh, d = k_cache.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = q.shape[1] // kvh
    k_flat, v_flat = k_cache.reshape(-1, kvh, d), v_cache.reshape(-1, kvh, d)
    outs = []
    for b in range(block_tables.shape[0]):
        r = b if rows is None else int(rows[b])
        length = int(context_lens[b])
        pos = torch.arange(0 if first_keys is None else int(first_keys[b]), length)
        slots = block_tables[b].long()[pos // bs] * bs + pos % bs
        k = k_flat[slots].float().repeat_interleave(g, dim=1)                  # [L, H, D]
        v = v_flat[slots].float().repeat_interleave(g, dim=1)
        s = scale * torch.einsum("hd,lhd->hl", q[r].float(), k)
        p = torch.softmax(softcap * torch.tanh(s / softcap) if softcap else s, dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(outs).to(q.dtype) if outs else q.new_empty((0, *q.shape[1:]))


if __name__ == "__main__":
    OPERATOR.main()
