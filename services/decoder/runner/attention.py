"""Attention over the paged KV cache: the CPU torch path.

Per layer, this step's K/V are first written into their cache slots (one index_copy_).
Then each request's new queries attend to its context [0, start + len):
- a chunk of several tokens (prefill) runs one SDPA call: over its own fresh K/V with a
  causal mask when it starts at 0 (nothing to read back), else over its context gathered
  from the cache with a bottom-right causal mask (query i sees keys <= start + i);
- 1-token rows (decode) run batched: rows of similar length share one SDPA call over their
  gathered blocks. Keys past a row's length (the tail of its last block, and blocks it lacks
  against the longest row of its group) are masked and get probability exactly 0; grouping
  bounds that padding to a quarter of the group's longest context (MAX_DECODE_PADDING),
  so the masked work stays small without one call per distinct length.

Slot indices and masks are built once per step (AttentionPlan) and reused by every layer,
and the gathers write into a reused workspace so steady-state decode allocates no new
large buffers per layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.decoder.runner.kv_cache import KVCache

# A decode row joins a group when it has at least (1 - this) of the group's longest block count.
MAX_DECODE_PADDING = 0.25


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_table [..., B] long, positions [...] long -> flat cache slots, same shape as positions."""
    blocks = torch.gather(block_table, -1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


@dataclass
class PrefillSpan:
    """One multi-token chunk: rows [lo, hi) of the step, physical positions start .. start+hi-lo-1."""

    lo: int
    hi: int
    context_slots: torch.Tensor | None   # [start + len] slots to read, None when start == 0
    mask: torch.Tensor | None            # [len, start + len] bool, True = attend; None: plain causal


@dataclass
class DecodeGroup:
    """All 1-token rows of the step, attended in one batched call over whole gathered blocks."""

    rows: torch.Tensor                   # [B] indices into the step's tokens
    blocks: torch.Tensor                 # [B * nb] block ids, row-major; short tables padded with block 0
    mask: torch.Tensor | None            # [B, 1, 1, nb * block_size] bool; None when every key is valid
    num_blocks: int                      # nb: blocks gathered per row


@dataclass
class AttentionPlan:
    slot_mapping: torch.Tensor           # [N] where each new token's K/V is written
    prefills: list[PrefillSpan]
    decode: list[DecodeGroup]

    @staticmethod
    def build(spans: list[tuple[int, int, list[int]]], block_size: int,
              device: torch.device) -> AttentionPlan:
        """spans: per chunk (start, length, block_table), in step order."""
        slot_parts, prefills, decode_rows, decode_starts, decode_tables = [], [], [], [], []
        offset = 0
        for start, length, table in spans:
            needed = -(-(start + length) // block_size)
            if len(table) < needed:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {start + length} positions")
            bt = torch.tensor(table[:needed], dtype=torch.long, device=device)
            if length > 1 and start > 0:
                key_pos = torch.arange(start + length, device=device)
                context = slots_of(bt, key_pos, block_size)
                query_pos = torch.arange(start, start + length, device=device)
                mask = key_pos[None, :] <= query_pos[:, None]
                prefills.append(PrefillSpan(offset, offset + length, context, mask))
                slot_parts.append(context[start:])
            elif length > 1:
                prefills.append(PrefillSpan(offset, offset + length, None, None))
                slot_parts.append(slots_of(bt, torch.arange(length, device=device), block_size))
            else:
                decode_rows.append(offset)
                decode_starts.append(start)
                decode_tables.append(bt)
                slot_parts.append(slots_of(bt, torch.tensor([start], device=device), block_size))
            offset += length
        decode = [_decode_group([decode_rows[i] for i in g], [decode_starts[i] for i in g],
                                [decode_tables[i] for i in g], block_size, device)
                  for g in _group_by_length([len(t) for t in decode_tables])]
        return AttentionPlan(torch.cat(slot_parts), prefills, decode)


def _group_by_length(num_blocks: list[int]) -> list[list[int]]:
    """Indices grouped longest first, each group's rows within MAX_DECODE_PADDING of its longest."""
    order = sorted(range(len(num_blocks)), key=lambda i: -num_blocks[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and num_blocks[i] >= (1 - MAX_DECODE_PADDING) * num_blocks[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _decode_group(rows: list[int], starts: list[int], tables: list[torch.Tensor], block_size: int,
                  device: torch.device) -> DecodeGroup:
    nb = max(len(t) for t in tables)
    blocks = torch.zeros(len(tables), nb, dtype=torch.long, device=device)
    for i, t in enumerate(tables):
        blocks[i, :len(t)] = t
    lens = torch.tensor(starts, dtype=torch.long, device=device) + 1             # [B] keys per row
    valid = torch.arange(nb * block_size, device=device)[None, :] < lens[:, None]
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    return DecodeGroup(torch.tensor(rows, dtype=torch.long, device=device), blocks.reshape(-1), mask, nb)


class Workspace:
    """Reused scratch buffers: a fresh multi-MB tensor per layer costs page faults on CPU."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


class PagedAttention:
    """The AttentionFn of one step: cache + plan; called once per layer by the model."""

    def __init__(self, cache: KVCache, plan: AttentionPlan, workspace: Workspace):
        self.cache, self.plan, self.workspace = cache, plan, workspace

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, H, D], k/v [N, KVH, D] -> [N, H, D]."""
        k_flat, v_flat = self.cache.flat(layer)
        k_flat.index_copy_(0, self.plan.slot_mapping, k)
        v_flat.index_copy_(0, self.plan.slot_mapping, v)
        out = torch.empty_like(q)
        for span in self.plan.prefills:
            out[span.lo:span.hi] = self._prefill(span, q, k, v, k_flat, v_flat)
        for group in self.plan.decode:
            out.index_copy_(0, group.rows, self._decode(group, layer, q))
        return out

    def _prefill(self, span: PrefillSpan, q, k, v, k_flat, v_flat) -> torch.Tensor:
        qs = q[span.lo:span.hi].transpose(0, 1)[None]                        # [1, H, L, D]
        if span.context_slots is None:
            ks, vs = k[span.lo:span.hi], v[span.lo:span.hi]
        else:
            ks, vs = k_flat[span.context_slots], v_flat[span.context_slots]   # [S, KVH, D]
        out = F.scaled_dot_product_attention(qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                             attn_mask=span.mask, is_causal=span.mask is None,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)                                         # [L, H, D]

    def _decode(self, group: DecodeGroup, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, nb = len(group.rows), group.num_blocks
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]           # [blocks, bs, KVH, D]
        _, bs, kvh, d = k_cache.shape
        # Whole-block gathers copy contiguous block_size*KVH*D runs: ~5x faster than per-slot rows.
        ks = torch.index_select(k_cache, 0, group.blocks, out=self.workspace.get("k", (b * nb, bs, kvh, d), k_cache))
        vs = torch.index_select(v_cache, 0, group.blocks, out=self.workspace.get("v", (b * nb, bs, kvh, d), v_cache))
        ks = ks.view(b, nb * bs, kvh, d).transpose(1, 2)                      # [B, KVH, L, D]
        vs = vs.view(b, nb * bs, kvh, d).transpose(1, 2)
        # Query heads of one KV group become that KV head's query rows: q head h reads KV head
        # h // G, so [B, H, D] -> [B, KVH, G, D]; SDPA then reads each K/V once, not G times.
        qs = q.index_select(0, group.rows).view(b, kvh, -1, d)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=group.mask)
        return out.reshape(b, -1, d)                                          # [B, H, D]
