"""Every decoder layer of a decode step in one C++ call, on CPU: the launcher and its torch ref.

The kernel is decode_stack_cpu.cpp next to this file (over the headers gemv.h, glue.h, tile_gemm.h
and paged_attention.h), compiled once per machine by native.load (`make kernels`). `make_stack`
builds the C++ object over a model's weights and KV cache once; `decode_stack` runs it for one
step; `decode_stack_ref` is the torch computation it must match (tests/decoder/kernels). Whether
it runs at all is decided at load by the runner (runner/fused_decode.py); this module only computes.

LoRA: `set_arenas` (or the stack's set_lora) gives each layer one arena per target (lora_cpu's form, A [P, K],
Bt [P, N]); a step passes each row's span per target (lora_offsets/lora_ranks [NUM_TARGETS, M] int32), and
each projection's output gets lora_cpu.lora_rows' corrections on its target's columns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.common import native

from . import gemv_cpu, gemv_grouped_cpu, widen_gemm_cpu
from .gemv_cpu import gemv_ref
from .gemv_grouped_cpu import gemv_grouped_ref
from .lora_cpu import lora_rows_ref
from .paged_attention_cpu import paged_decode_ref

SOURCE = Path(__file__).with_suffix(".cpp")
KERNEL_ROWS = gemv_cpu.MAX_ROWS   # the few-row kernel's most rows; above a projection's gemv_rows, the library's
TILES_ABOVE = 4                   # the panels (tiles) run above this many rows, before gemv_cpu
# LoRA targets in lora.weights.TARGETS order (q, k, v, o, gate, up, down): the rows of lora_offsets/lora_ranks.
NUM_TARGETS = 7
WIDEN = (None, torch.float32, torch.bfloat16)     # Projection.widen as the operator takes it (its index)
OPERATOR = native.Operator("decode_stack_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


@dataclass
class Projection:
    weight: torch.Tensor                 # [out, in] float32, bfloat16, or int8 with scale; or grouped codes
    scale: torch.Tensor | None = None    # [out] per-row scale of an int8 weight; fp16 [out, in // group] if grouped
    bias: torch.Tensor | None = None     # [out]
    # Up to gemv_rows rows (<= KERNEL_ROWS) gemv_cpu (grouped: gemv_grouped_cpu) runs it; above, for dense weights,
    # linear_path.pack(weight) at the row counts that `rule` gives as (starts, flags), linear_path.Rule's
    # form, and F.linear at the others.
    gemv_rows: int = KERNEL_ROWS
    packed: torch.Tensor | None = None
    rule: tuple[tuple[int, ...], tuple[bool, ...]] = ((1,), (False,))
    # Above TILES_ABOVE rows, whatever its gemv_rows, a weight with tiles = tile_gemm_cpu.pack(weight) runs
    # tile_gemm_cpu instead (fp32 sums, like the others); with tiles_amx, tiles = tile_unit.pack_panels(weight)
    # (bf16) runs on the tile unit.
    tiles: torch.Tensor | None = None
    # bf16 x over a bf16 weight: which of gemv_cpu.BF16_ROWS the few-row kernel runs (its Linear's choice).
    bf16_row: str = gemv_cpu.BF16_ROWS[0]
    # Whether the few-row kernel asks for the weight ahead of the row it reads (gemv_cpu.reading).
    prefetch: bool = False
    # Its order over the weight rows (one of gemv_cpu.STREAMS).
    streams: str = "one"
    # A grouped weight (model/grouped.py's layout): weight its uint8 codes [out, in * bits // 8], scale and offset
    # fp16 [out, in // group]; gemv_grouped_cpu runs it up to its MAX_ROWS rows, as int8, by grouped_loop (one of its
    # WIDEST: its Linear's choice).
    offset: torch.Tensor | None = None
    bits: int = 0
    group: int = 0
    grouped_loop: str = gemv_grouped_cpu.WIDEST[0]
    # Above gemv_rows, an int8 or grouped weight runs widen_gemm_cpu with products in this dtype (its Linear's
    # many-row path is `tiles` or `amx`), or is refused (None); on `kernel` (widen_gemm_cpu.KERNELS: "amx"
    # multiplies in bf16 on the tile unit).
    widen: torch.dtype | None = None
    kernel: str = "dot"
    tiles_amx: bool = False     # see tiles


@dataclass
class LayerWeights:
    input_norm: torch.Tensor             # [hidden], the activations' dtype
    post_norm: torch.Tensor              # [hidden]
    qkv: Projection                      # [(H + 2 KVH) D, hidden]: q | k | v
    o: Projection                        # [hidden, H D]
    gate_up: Projection                  # [2 I, hidden]: gate | up
    down: Projection                     # [hidden, I]
    k_cache: torch.Tensor                # [NB, BS, KVH, D] contiguous, the activations' dtype
    v_cache: torch.Tensor
    q_norm: torch.Tensor | None = None   # [D] (Qwen3: RMSNorm per head before the rotary)
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    eps: float


@dataclass
class StackLora:
    """One step's adapters, as decode_stack_ref takes them (decode_stack holds the arenas: set_arenas).

    arenas[layer]: target index (lora.weights.TARGETS order) -> (A [P, K], Bt [P, N]) in the activations' dtype,
    K and N the target's projection input and output widths (q: hidden -> H D, k/v: hidden -> KVH D, o: H D ->
    hidden, gate/up: hidden -> I, down: I -> hidden). offsets, ranks [NUM_TARGETS, M] int32: row m's span in
    target t's arenas (rank 0: none; lora_cpu.lora_rows).
    """
    arenas: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]
    offsets: torch.Tensor
    ranks: torch.Tensor


def set_arenas(stack, arenas: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]) -> None:
    """Give every layer of `stack` its arenas (StackLora.arenas' form); targets absent from a layer's dict are
    cleared. The tensors are held, not copied: call again after an arena is reallocated, between steps."""
    for layer, per_target in enumerate(arenas):
        for target in range(NUM_TARGETS):
            a, bt = per_target.get(target, (None, None))
            stack.set_lora(layer, target, a, bt)


def make_stack(shape: Shape, layers: list[LayerWeights], final_norm: torch.Tensor):
    """The compiled DecodeStack over these tensors (held, not copied: weights and caches stay shared;
    norms, scales and biases are copied to fp32 once). final_norm's dtype is the activations'."""
    stack = load().DecodeStack(shape.heads, shape.kv_heads, shape.head_dim, shape.hidden, shape.intermediate,
                               shape.eps, final_norm)
    for w in layers:
        stack.add_layer(w.input_norm, w.post_norm, w.q_norm, w.k_norm, _projection(w.qkv), _projection(w.o),
                        _projection(w.gate_up), _projection(w.down), w.k_cache, w.v_cache)
    return stack


def _projection(p: Projection):
    return load().Projection(p.weight, p.scale, p.bias, p.packed, list(p.rule[0]), list(p.rule[1]), p.gemv_rows,
                             p.tiles, gemv_cpu.BF16_ROWS.index(p.bf16_row), p.offset, p.bits, p.group,
                             3 if p.widen is not None and p.kernel == "amx" else WIDEN.index(p.widen), p.tiles_amx,
                             gemv_grouped_cpu.LOOPS.index(p.grouped_loop),
                             *gemv_cpu.reading(p.prefetch, p.streams))


def decode_stack(stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, lora_offsets: torch.Tensor | None = None,
                 lora_ranks: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, hidden] (embeddings) -> final-normed hidden states [M, hidden], in x (in place).

    Row m is one token at cache slot slots[m] (int64) attending to block_tables[m] (int32, [M, nb])
    up to context_lens[m] keys (int32, its position + 1). cos/sin [M, D] from Rotary.cos_sin (sin's
    first half negated). Every layer writes the rows' K/V into its cache at `slots`, as the model's
    own layers do; see decode_stack_ref for the computation. Each projection runs tile_gemm_cpu above
    TILES_ABOVE rows (if it has tiles), else gemv_cpu up to its gemv_rows rows, else its packed or plain
    library matmul (int8 and grouped weights: widen_gemm_cpu where they have `widen`, else refused).
    lora_offsets, lora_ranks [NUM_TARGETS, M] int32 (or None: no adapters): each row's span per target in the
    arenas set on the stack (set_arenas); a row of rank 0 for every target comes out bit for bit as without them.
    """
    stack.forward(x, cos.contiguous(), sin.contiguous(), slots, block_tables.to(torch.int32).contiguous(),
                  context_lens.to(torch.int32).contiguous(), lora_offsets, lora_ranks)
    return x


def decode_stack_ref(shape: Shape, layers: list[LayerWeights], final_norm: torch.Tensor, x: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, lora: StackLora | None = None) -> torch.Tensor:
    """The torch reference of decode_stack (model/layers.py's computation, one row per token);
    writes the same cache slots and returns [M, hidden] in x's dtype. lora: each projection's output gets
    lora_cpu.lora_rows_ref's corrections on its targets' columns."""
    dtype, (h, kvh, d) = x.dtype, (shape.heads, shape.kv_heads, shape.head_dim)
    m = x.shape[0]

    def norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        f = t.float()
        return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + shape.eps)).to(dtype)

    def linear(t: torch.Tensor, p: Projection, layer: int, targets: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
        """targets: (target index, first column, columns) of each LoRA target on this projection's output."""
        if p.widen is not None and t.shape[0] > p.gemv_rows:
            out = widen_gemm_cpu.gemm_ref(t, p.weight, p.scale, p.offset, p.bits, p.group, p.bias, p.widen).to(dtype)
        elif p.offset is not None:
            out = gemv_grouped_ref(t, p.weight, p.scale, p.offset, p.bits, p.group, p.bias).to(dtype)
        else:
            out = gemv_ref(t, p.weight, p.scale, p.bias).to(dtype)     # fp32 sums, one rounding
        for target, col, n in targets if lora is not None else ():
            if target in lora.arenas[layer]:
                a, bt = lora.arenas[layer][target]
                out[:, col:col + n] = lora_rows_ref(out[:, col:col + n], t, a, bt, lora.offsets[target],
                                                    lora.ranks[target])
        return out

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return t * cos[:, None] + t.roll(d // 2, -1) * sin[:, None]

    inter = shape.intermediate
    qkv_targets = ((0, 0, h * d), (1, h * d, kvh * d), (2, (h + kvh) * d, kvh * d))
    for i, w in enumerate(layers):
        qkv = linear(norm(x, w.input_norm), w.qkv, i, qkv_targets)
        q, k, v = qkv.split((h * d, kvh * d, kvh * d), dim=1)
        q, k, v = q.reshape(m, h, d), k.reshape(m, kvh, d), v.reshape(m, kvh, d)
        if w.q_norm is not None:
            q, k = norm(q, w.q_norm), norm(k, w.k_norm)
        q, k = rotate(q), rotate(k)
        w.k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
        w.v_cache.view(-1, kvh, d).index_copy_(0, slots, v)
        attn = paged_decode_ref(q, w.k_cache, w.v_cache, block_tables, context_lens, 1 / math.sqrt(d))
        x = x + linear(attn.reshape(m, h * d), w.o, i, ((3, 0, shape.hidden),))
        gate, up = linear(norm(x, w.post_norm), w.gate_up, i, ((4, 0, inter), (5, inter, inter))).chunk(2, dim=1)
        x = x + linear(F.silu(gate) * up, w.down, i, ((6, 0, shape.hidden),))
    return norm(x, final_norm)


if __name__ == "__main__":
    OPERATOR.main()
