"""Attention over the paged KV cache on CPU: the C++ in-place operator or the torch path.

Per layer, this step's K/V are first written into their cache slots (one index_copy_).
Then each request's new queries attend to its context [0, start + len):
- a chunk of several tokens (prefill) runs one SDPA call: over its own fresh K/V with a
  causal mask when it starts at 0 (nothing to read back), else over its context gathered
  from the cache with a bottom-right causal mask (query i sees keys <= start + i); on
  cpp-paged, a short chunk after 0 (PREFILL_IN_PLACE_MAX) runs as decode rows instead;
- 1-token rows (decode) run on one of two backends, chosen once per runner at load
  (choose_decode_backend) and passed to every AttentionPlan.build:
  - "cpp-paged": one call of the C++ operator over all of them (kernels/paged_attention_cpu),
    which reads each row's blocks in place through its block table: no gather, no padding;
  - "torch-gather", the reference and the fallback when the operator cannot be built: rows of
    similar length share one SDPA call over their gathered blocks. Keys past a row's length (the
    tail of its last block, and blocks it lacks against the longest row of its group) are masked
    and get probability exactly 0; grouping bounds that padding to a quarter of the group's
    longest context (MAX_DECODE_PADDING), so the masked work stays small without one call per
    distinct length.
  The `attention` entry of --fast-paths (services/common/plan.py) = auto (default: both timed at the
  model's shapes with the plan's timer, the operator kept on a tie; the torch path with a WARNING when
  the operator cannot be built) | cpp (the operator or an error) | torch (tests, A/B benchmarks).

Slot indices and masks are built once per step (AttentionPlan) and reused by every layer,
and the gathers write into a reused workspace so steady-state decode allocates no new
large buffers per layer. Sliding windows and the soft-cap (runner/windows.py) hold on every path: one
mask (or first key, for the operator) per distinct window, each layer picking its own, and gathers that
start at the first key any layer still reads; soft-capped layers run the scores written out in torch
(softcapped_attention) or the operator's own soft-cap.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.common import native
from services.common import plan as execution
from services.decoder.kernels import paged_attention_cpu
from services.decoder.runner.kv_cache import KVCache
from services.decoder.runner.windows import Windows, key_mask, softcapped_attention

log = logging.getLogger("tessera.attention")

CPP, TORCH = "cpp-paged", "torch-gather"
# The --fast-paths names of the two backends.
NAMES = {"cpp": CPP, "torch": TORCH}

# A decode row joins a group when it has at least (1 - this) of the group's longest block count.
MAX_DECODE_PADDING = 0.25

# On cpp-paged, a chunk of at most this many tokens that starts after 0 runs as that many decode
# rows (query i over keys [0, start + i]) through the operator too, instead of a gather and a
# masked SDPA. Each row re-reads the context, so SDPA's blocked kernel wins on long chunks;
# measured on a Zen 4 (2 threads, context 300 and 1000, fp32 and bf16): 1.6-6x faster at 2-8
# tokens, 1.2-2.1x at 16, even at 32, 0.7-1.0x at 64.
PREFILL_IN_PLACE_MAX = 16
# A first chunk (start 0) of at most this many tokens runs as decode rows as well: row i reads keys
# [0, i] of the blocks this step has just written, so the work is SDPA's causal triangle without its
# per-call cost, which dominates short prompts. Measured on a Zen 4 (SmolLM2 shapes: 9 heads over 3
# KV heads of 64, 2 threads), operator vs SDPA: bf16 1.8x at 95 tokens, 1.3x at 160, 1.0x at 256,
# 0.5x at 2,048; fp32 2.3x, 1.5x, 1.1x, 0.5x.
FIRST_CHUNK_IN_PLACE_MAX = 192


def resolve_backend(pin: str) -> tuple[str, str]:
    """(the backend a pin allows, why when it is not the one asked for): torch when pinned so or when the
    operator cannot be built under auto (logged as a WARNING); pinned cpp, the operator or BuildError."""
    if pin == "torch":
        return TORCH, ""
    try:
        paged_attention_cpu.load()
    except native.BuildError as e:
        if pin == "cpp":
            raise
        log.warning("decode attention: %s; the C++ paged operator is unavailable: %s", TORCH, e)
        return TORCH, f"unavailable: {str(e).splitlines()[0]}"
    return CPP, ""


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_table [..., B] long, positions [...] long -> flat cache slots, same shape as positions."""
    blocks = torch.gather(block_table, -1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


# A window's mask (or first keys): window -> its tensor, or None where nothing beyond causality is masked.
Masks = dict[int | None, torch.Tensor | None]


@dataclass
class PrefillSpan:
    """One multi-token chunk: rows [lo, hi) of the step, physical positions start .. start+hi-lo-1."""

    lo: int
    hi: int
    context_slots: torch.Tensor | None   # [S] slots of keys first .. start + len - 1; None when start == 0
    masks: Masks                         # per window [len, S] bool, True = attend; None: plain causal


@dataclass
class DecodeGroup:
    """All 1-token rows of the step, attended in one batched call over whole gathered blocks."""

    rows: torch.Tensor                   # [B] indices into the step's tokens
    blocks: torch.Tensor                 # [B * nb] block ids from each row's first read block, row-major;
    #                                      short tables padded with block 0
    masks: Masks                         # per window [B, 1, 1, nb * block_size] bool; None: every key valid
    num_blocks: int                      # nb: blocks gathered per row


@dataclass
class DecodeRows:
    """The rows the in-place operator attends (one call per layer): every 1-token row, and each
    row of a short chunk (PREFILL_IN_PLACE_MAX tokens after 0, FIRST_CHUNK_IN_PLACE_MAX at 0)."""

    rows: torch.Tensor | None            # [B] long indices into the step's tokens; None: they are 0..B-1
    block_tables: torch.Tensor           # [B, nb] int32, short tables padded with block 0 (never read)
    context_lens: torch.Tensor           # [B] int32, keys per row (its position + 1)
    first_keys: Masks = dataclasses.field(default_factory=dict)  # per window [B] int32 first key; None: 0


@dataclass
class AttentionPlan:
    slot_mapping: torch.Tensor           # [N] where each new token's K/V is written
    prefills: list[PrefillSpan]
    decode: list[DecodeGroup]            # torch-gather backend; empty on cpp-paged
    decode_rows: DecodeRows | None = None  # cpp-paged backend, None when the step has no decode row
    windows: Windows = Windows()         # each layer's window and the soft-cap

    @staticmethod
    def build(spans: list[tuple[int, int, list[int]]], block_size: int,
              device: torch.device, backend: str, windows: Windows = Windows()) -> AttentionPlan:
        """spans: per chunk (start, length, block_table), in step order; a table entry before the chunk's
        first read key (windows.first_key) may be a freed block's placeholder and is never read. backend: the
        runner's decode backend (CPP or TORCH); off CPU the torch path runs whatever it says."""
        device = torch.device(device)
        if backend not in (CPP, TORCH):
            raise ValueError(f"decode attention backend {backend!r}: expected {CPP} or {TORCH}")
        if device.type != "cpu":
            backend = TORCH
        slots = _SlotMapping(device)
        prefills, decode_rows, decode_starts, decode_tables = [], [], [], []
        offset = 0
        for start, length, table in spans:
            needed = -(-(start + length) // block_size)
            if len(table) < needed:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {start + length} positions")
            if length == 1 or (backend == CPP and length <= (PREFILL_IN_PLACE_MAX if start > 0
                                                             else FIRST_CHUNK_IN_PLACE_MAX)):
                # Plain ints: a handful of tiny tensor ops per decode row would cost more than the row.
                for i in range(length):
                    decode_rows.append(offset + i)
                    decode_starts.append(start + i)
                    decode_tables.append(table[:needed])
                    p = start + i
                    slots.add_int(table[p // block_size] * block_size + p % block_size)
                offset += length
                continue
            bt = torch.tensor(table[:needed], dtype=torch.long, device=device)
            query_pos = torch.arange(start, start + length, device=device)
            if start > 0:
                first = windows.first_key(start)
                key_pos = torch.arange(first, start + length, device=device)
                context = slots_of(bt, key_pos, block_size)
                masks = {w: key_mask(query_pos, key_pos, w) for w in windows.distinct}
                prefills.append(PrefillSpan(offset, offset + length, context, masks))
                slots.add_tensor(context[start - first:])
            else:
                masks = {w: None if w is None or w >= length else key_mask(query_pos, query_pos, w)
                         for w in windows.distinct}
                prefills.append(PrefillSpan(offset, offset + length, None, masks))
                slots.add_tensor(slots_of(bt, query_pos, block_size))
            offset += length
        if backend == CPP:
            rows = _decode_rows(decode_rows, decode_starts, decode_tables, device, windows) if decode_rows else None
            return AttentionPlan(slots.tensor(), prefills, [], rows, windows)
        # Each torch row gathers from the block of its first read key: freed blocks before it are not read.
        firsts = [windows.first_key(p) // block_size for p in decode_starts]
        tables = [t[f:] for t, f in zip(decode_tables, firsts, strict=True)]
        decode = [_decode_group([decode_rows[i] for i in g], [decode_starts[i] for i in g],
                                [firsts[i] * block_size for i in g],
                                [torch.tensor(tables[i], dtype=torch.long, device=device) for i in g],
                                block_size, device, windows)
                  for g in _group_by_length([len(t) for t in tables])]
        return AttentionPlan(slots.tensor(), prefills, decode, None, windows)


class _SlotMapping:
    """The step's slot mapping from tensor parts (prefill chunks) and single ints (decode rows)."""

    def __init__(self, device: torch.device):
        self.device, self.parts, self.ints = device, [], []

    def add_int(self, slot: int) -> None:
        self.ints.append(slot)

    def add_tensor(self, part: torch.Tensor) -> None:
        self._flush()
        self.parts.append(part)

    def _flush(self) -> None:
        if self.ints:
            self.parts.append(torch.tensor(self.ints, dtype=torch.long, device=self.device))
            self.ints = []

    def tensor(self) -> torch.Tensor:
        self._flush()
        if not self.parts:
            return torch.empty(0, dtype=torch.long, device=self.device)
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


def _decode_rows(rows: list[int], starts: list[int], tables: list[list[int]], device: torch.device,
                 windows: Windows) -> DecodeRows:
    nb = max(len(t) for t in tables)
    padded = [t + [0] * (nb - len(t)) for t in tables]
    identity = rows == list(range(len(rows)))
    firsts: Masks = {}
    for w in windows.distinct:
        keys = [0 if w is None else max(0, p - w + 1) for p in starts]
        firsts[w] = torch.tensor(keys, dtype=torch.int32, device=device) if any(keys) else None
    return DecodeRows(None if identity else torch.tensor(rows, dtype=torch.long, device=device),
                      torch.tensor(padded, dtype=torch.int32, device=device),
                      torch.tensor(starts, dtype=torch.int32, device=device) + 1, firsts)


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


def _decode_group(rows: list[int], starts: list[int], bases: list[int], tables: list[torch.Tensor],
                  block_size: int, device: torch.device, windows: Windows) -> DecodeGroup:
    """bases: per row the position of its first gathered key (its first table entry's first slot)."""
    nb = max(len(t) for t in tables)
    blocks = torch.zeros(len(tables), nb, dtype=torch.long, device=device)
    for i, t in enumerate(tables):
        blocks[i, :len(t)] = t
    pos = torch.tensor(starts, dtype=torch.long, device=device)                  # [B] each row's query
    key_pos = torch.tensor(bases, dtype=torch.long, device=device)[:, None] + \
        torch.arange(nb * block_size, device=device)[None, :]                    # [B, nb * bs]
    masks: Masks = {}
    for w in windows.distinct:
        valid = key_mask(pos[:, None], key_pos, w)[:, 0]                         # [B, nb * bs]
        masks[w] = None if bool(valid.all()) else valid[:, None, None, :]
    return DecodeGroup(torch.tensor(rows, dtype=torch.long, device=device), blocks.reshape(-1), masks, nb)


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

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None = None) -> torch.Tensor:
        """q [N, H, D], k/v [N, KVH, D] -> [N, H, D]; softmax scale (None: 1/sqrt(D)) as model/layers.py's
        AttentionFn."""
        k_flat, v_flat = self.cache.flat(layer)
        k_flat.index_copy_(0, self.plan.slot_mapping, k)
        v_flat.index_copy_(0, self.plan.slot_mapping, v)
        out = torch.empty_like(q)
        window, softcap = self.plan.windows.of(layer), self.plan.windows.softcap
        for span in self.plan.prefills:
            out[span.lo:span.hi] = self._prefill(span, q, k, v, k_flat, v_flat, scale, window)
        if self.plan.decode_rows is not None:
            d = self.plan.decode_rows
            paged_attention_cpu.paged_decode(q, self.cache.k[layer], self.cache.v[layer], d.block_tables,
                                             d.context_lens, scale, rows=d.rows, out=out,
                                             first_keys=d.first_keys.get(window), softcap=softcap)
        for group in self.plan.decode:
            out.index_copy_(0, group.rows, self._decode(group, layer, q, scale, window))
        return out

    def _prefill(self, span: PrefillSpan, q, k, v, k_flat, v_flat, scale: float | None,
                 window: int | None) -> torch.Tensor:
        qs = q[span.lo:span.hi].transpose(0, 1)[None]                        # [1, H, L, D]
        if span.context_slots is None:
            ks, vs = k[span.lo:span.hi], v[span.lo:span.hi]
        else:
            ks, vs = k_flat[span.context_slots], v_flat[span.context_slots]   # [S, KVH, D]
        ks, vs, mask = ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], span.masks[window]
        softcap = self.plan.windows.softcap
        if softcap is not None:
            if mask is None:
                mask = torch.ones(qs.shape[2], qs.shape[2], dtype=torch.bool, device=qs.device).tril()
            out = softcapped_attention(qs, ks, vs, mask, scale, softcap)
        else:
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                                 scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)                                         # [L, H, D]

    def _decode(self, group: DecodeGroup, layer: int, q: torch.Tensor, scale: float | None,
                window: int | None) -> torch.Tensor:
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
        mask, softcap = group.masks[window], self.plan.windows.softcap
        if softcap is not None:
            out = softcapped_attention(qs.reshape(b, -1, 1, d), ks, vs,
                                       None if mask is None else mask[:, :, None], scale, softcap)
        else:
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        return out.reshape(b, -1, d)                                          # [B, H, D]


# Decode rows and context length at which choose_decode_backend times the two paths.
TIMING_ROWS, TIMING_CONTEXT = (1, 64), 256


def choose_decode_backend(record: execution.ExecutionPlan, num_heads: int, num_kv_heads: int, head_dim: int,
                          block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """The decode backend for this model on this machine (the choice "attention" of record).

    Pinned, or with the operator unavailable, that backend. Under auto both paths run one layer's
    decode attention over a scratch cache at TIMING_ROWS rows of TIMING_CONTEXT keys (plan.fastest),
    and the smaller total wins by the plan's tie rule, the operator kept on a tie (about 0.1 s at
    load). Off CPU, the torch path.
    """
    if torch.device(device).type != "cpu":
        record.record("attention", "torch", reason="not on CPU")
        return TORCH
    pin = record.pinned("attention")
    backend, why = resolve_backend(pin)
    if pin != execution.AUTO or backend != CPP:
        record.record("attention", "cpp" if backend == CPP else "torch", reason=why)
        return backend
    totals, timings = {"cpp": 0.0, "torch": 0.0}, []
    for rows in TIMING_ROWS:
        took = _time_decode(rows, num_heads, num_kv_heads, head_dim, block_size, dtype)
        timings += [execution.Timing(name, t, rows) for name, t in took.items()]
        for name in totals:
            totals[name] += took[name]
    chosen = execution.pick(totals, "cpp")
    record.record("attention", chosen, timings,
                  f"timed at {num_heads}/{num_kv_heads} heads x {head_dim}, block {block_size}, "
                  f"{str(dtype).removeprefix('torch.')}, {TIMING_CONTEXT} keys")
    return NAMES[chosen]


def _time_decode(rows: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype) -> dict[str, float]:
    """{"cpp": s, "torch": s}: one layer's attention for `rows` decode rows on each backend."""
    per_row = -(-TIMING_CONTEXT // block_size)
    cache = KVCache(1, rows * per_row, block_size, num_kv_heads, head_dim, dtype)
    cache.k[0].normal_()
    cache.v[0].normal_()
    # Rows own interleaved blocks, as a long-running cache ends up: no row reads a contiguous run.
    spans = [(TIMING_CONTEXT - 1, 1, list(range(r, rows * per_row, rows))) for r in range(rows)]
    q = torch.randn(rows, num_heads, head_dim).to(dtype)
    k, v = (torch.randn(rows, num_kv_heads, head_dim).to(dtype) for _ in range(2))
    calls = {}
    for name, backend in NAMES.items():
        attend = PagedAttention(cache, AttentionPlan.build(spans, block_size, torch.device("cpu"), backend),
                                Workspace())
        calls[name] = lambda attend=attend: attend(0, q, k, v)
    return execution.fastest(calls)
