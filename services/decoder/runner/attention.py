"""Attention over the paged KV cache: the CPU torch path.

Per layer, this step's K/V are first written into their cache slots (one index_copy_).
Then each request's new queries attend to its context [0, start + len):
- a chunk of several tokens (prefill) runs one SDPA call: over its own fresh K/V with a
  causal mask when it starts at 0 (nothing to read back), else over its context gathered
  from the cache with a bottom-right causal mask (query i sees keys <= start + i);
- all 1-token rows (decode) run together in one batched SDPA over their gathered contexts.
  Rows shorter than the longest are masked; the masked keys get probability exactly 0.

Slot indices and masks are built once per step (AttentionPlan) and reused by every layer,
and the gathers write into a reused workspace so steady-state decode allocates no new
large buffers per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.decoder.runner.kv_cache import KVCache


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
    """All 1-token rows of the step, attended in one batched call."""

    rows: torch.Tensor                   # [B] indices into the step's tokens
    context_slots: torch.Tensor          # [B * Lmax] slots, row-major; padding points at slot 0
    mask: torch.Tensor | None            # [B, 1, 1, Lmax] bool, None when all contexts have Lmax keys
    max_len: int


@dataclass
class AttentionPlan:
    slot_mapping: torch.Tensor           # [N] where each new token's K/V is written
    prefills: list[PrefillSpan]
    decode: DecodeGroup | None

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
                context = slots_of(bt, torch.arange(start + length, device=device), block_size)
                key_pos = torch.arange(start + length, device=device)
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
        decode = None
        if decode_rows:
            decode = _decode_group(decode_rows, decode_starts, decode_tables, block_size, device)
        return AttentionPlan(torch.cat(slot_parts), prefills, decode)


def _decode_group(rows: list[int], starts: list[int], tables: list[torch.Tensor], block_size: int,
                  device: torch.device) -> DecodeGroup:
    lens = torch.tensor(starts, dtype=torch.long, device=device) + 1            # [B] keys per row
    max_len = int(lens.max())
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.long, device=device)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    positions = torch.arange(max_len, device=device).expand(len(rows), max_len)
    valid = positions < lens[:, None]
    # Padding positions read slot 0 (any valid slot) and are masked out below.
    slots = torch.where(valid, slots_of(bt, positions.clamp(max=width * block_size - 1), block_size), 0)
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    return DecodeGroup(torch.tensor(rows, dtype=torch.long, device=device), slots.reshape(-1), mask, max_len)


class Workspace:
    """Reused scratch buffers: a fresh multi-MB tensor per layer costs page faults on CPU."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
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
        if self.plan.decode is not None:
            out.index_copy_(0, self.plan.decode.rows, self._decode(q, k_flat, v_flat))
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

    def _decode(self, q, k_flat, v_flat) -> torch.Tensor:
        group = self.plan.decode
        b, kvh, d = len(group.rows), k_flat.shape[1], k_flat.shape[2]
        shape = (b * group.max_len, kvh, d)
        ks = torch.index_select(k_flat, 0, group.context_slots, out=self.workspace.get("k", shape, k_flat))
        vs = torch.index_select(v_flat, 0, group.context_slots, out=self.workspace.get("v", shape, v_flat))
        ks = ks.view(b, group.max_len, kvh, d).transpose(1, 2)                 # [B, KVH, Lmax, D]
        vs = vs.view(b, group.max_len, kvh, d).transpose(1, 2)
        qs = q.index_select(0, group.rows)[:, :, None, :]                     # [B, H, 1, D]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=group.mask, enable_gqa=True)
        return out[:, :, 0, :]                                                # [B, H, D]
