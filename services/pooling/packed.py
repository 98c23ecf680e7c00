"""A packed forward (fp32, or bf16 with --dtype bfloat16) for BERT, RoBERTa and XLM-RoBERTa encoders: no
padding in any linear layer.

Why: on CPU the linear layers dominate a small encoder's forward. transformers'
BertModel runs them over the padded [B, L] grid and splits Q/K/V into three GEMMs.
Here tokens of all rows are concatenated into one [T, H] matrix (T = real tokens),
Q/K/V is one fused GEMM. Attention runs per sequence on the packed rows in a C++ operator
(attention_cpu.py) where it builds and is faster at load (services/common/plan.py); otherwise it is padded
only within groups of rows of similar length (`attention_groups`): padding every row to the batch's longest
made attention cost B * longest^2, which took a fifth of MiniLM's forward on real sentences; grouped, the
forward is ~0.75x as long, and the operator takes attention from ~4-6 ms to ~1.7 ms per layer of 52 sentences.
It computes exactly BertModel's, RobertaModel's and XLMRobertaModel's function (the same layers; only the
position ids differ); tests compare it with transformers. Every other family runs transformers' forward (`unsupported`).
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.common import linear_path, native, split_products
from services.common import plan as execution

from . import attention_cpu

log = logging.getLogger("tessera.pooling.packed")

_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

# One attention call's fixed cost in units of its variable cost (rows x width^2): SDPA over
# [1, 12, 8, 32] costs about what 1000 more rows x width^2 cost at sentence widths (timed on an AMD
# EPYC; the grouped attention's total varied by under 10 % for anything from 1000 to 3000).
CALL_COST = 1024
# Rows one group may take; bounds the grouping's own work at O(rows x this) for large batches.
MAX_GROUP_ROWS = 64


def attention_groups(lengths: list[int], call_cost: int = CALL_COST) -> list[tuple[int, int]]:
    """Split rows sorted by length (ascending) into contiguous groups [start, end), each padded to
    its longest row, minimising sum(call_cost + rows * longest^2): optimal by dynamic programming."""
    best, cut = [0] * (len(lengths) + 1), [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):
        width = lengths[end - 1] ** 2
        best[end], cut[end] = min((best[i] + call_cost + (end - i) * width, i)
                                  for i in range(max(0, end - MAX_GROUP_ROWS), end))
    groups, end = [], len(lengths)
    while end:
        groups.append((cut[end], end))
        end = cut[end]
    return groups[::-1]


# {path: call} -> {path: seconds}; plan.fastest unless a test swaps it.
Timer = Callable[[dict[str, Callable[[], object]]], dict[str, float]]


def choose_attention(heads: int, head_dim: int, dtype: torch.dtype, record: execution.ExecutionPlan,
                     timer: Timer | None = None) -> tuple[bool, str]:
    """(whether the C++ operator runs attention, a one-line summary), the choice "encoder_attention" of
    record: the pinned path, else the faster of it and the grouped SDPA by the plan's tie rule (SDPA kept
    on a tie), timed at load on 16 sentence-like sequences (8 to 68 tokens); the grouped SDPA when the
    operator cannot be had here (the reason is logged). timer (tests) replaces the clock."""
    pin = record.pinned("encoder_attention")
    if pin == "torch":
        record.record("encoder_attention", "torch")
        return False, "torch-grouped (--fast-paths encoder_attention=torch)"
    try:
        attention_cpu.load()
    except native.BuildError as e:
        if pin == "cpp":
            raise
        log.warning("encoder attention operator unavailable, attention runs grouped SDPA: %s", e)
        record.record("encoder_attention", "torch", reason=f"cpp unavailable: {str(e).splitlines()[0]}")
        return False, f"torch-grouped (cpp unavailable: {str(e).splitlines()[0]})"
    if pin == "cpp":
        record.record("encoder_attention", "cpp")
        return True, "cpp (--fast-paths encoder_attention=cpp)"
    lengths = sorted(random.Random(0).randint(8, 68) for _ in range(16))
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim).to(dtype)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    groups = _groups(lengths)
    out = torch.empty(qkv.shape[0], heads * head_dim, dtype=dtype)

    def grouped():
        for group in groups:
            group.attend(qkv, out, heads)
    with torch.inference_mode():
        took = (timer or execution.fastest)({"cpp": lambda: attention_cpu.attention(qkv, offsets, heads),
                                             "torch": grouped})
    chosen = execution.pick(took, "torch")
    record.record("encoder_attention", chosen, [execution.Timing(k, v) for k, v in took.items()],
                  "16 sequences of 8-68 tokens")
    timed = f"timed cpp {took['cpp'] * 1e3:.2f} vs grouped {took['torch'] * 1e3:.2f} ms"
    return chosen == "cpp", f"{'cpp' if chosen == 'cpp' else 'torch-grouped'} ({timed})"


def _groups(lengths: list[int]) -> list[_Group]:
    """attention_groups of ascending lengths as _Group objects over consecutive token ranges."""
    groups, first = [], 0
    for start, end in attention_groups(lengths):
        groups.append(_Group(lengths[start:end], first))
        first = groups[-1].last
    return groups


class _Group:
    """Rows of the length-sorted batch, as one attention call padded to `width`.

    [first, last): their token range in the packed [T, ...] activations. When every row has the same
    length the grid is a plain view of that range; otherwise `slots` [rows * width] gathers it (pad
    slots read token `first`, and `mask` [rows, 1, 1, width] hides them as keys) and `valid`
    [last - first] picks the real rows of the result back out."""

    def __init__(self, lengths: list[int], first: int):
        self.rows, self.width = len(lengths), max(lengths)
        self.first, self.last = first, first + sum(lengths)
        self.mask = self.slots = self.valid = None
        if min(lengths) != self.width:
            mask = torch.arange(self.width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
            self.valid = mask.reshape(-1).nonzero().squeeze(1)
            self.slots = torch.full((self.rows * self.width,), first, dtype=torch.long)
            self.slots[self.valid] = torch.arange(self.first, self.last)
            self.mask = mask[:, None, None, :]

    def attend(self, qkv: torch.Tensor, out: torch.Tensor, heads: int) -> None:
        """qkv [T, 3H] -> this group's attention context into out [T, H]."""
        grid = qkv[self.first:self.last] if self.slots is None else qkv.index_select(0, self.slots)
        q, k, v = grid.view(self.rows, self.width, 3, heads, -1).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)      # [rows, nh, width, d]
        ctx = ctx.transpose(1, 2).reshape(self.rows * self.width, out.shape[1])
        out[self.first:self.last] = ctx if self.valid is None else ctx.index_select(0, self.valid)


# The encoders whose function the packed forward computes -> whether positions are RoBERTa's (counted from
# pad_token_id + 1, pad tokens skipped) rather than BERT's 0, 1, 2...
_ENCODERS = {"BertModel": False, "RobertaModel": True, "XLMRobertaModel": True}


def unsupported(model: torch.nn.Module) -> str:
    """Why the packed forward does not compute model's function, in a few words; "" where it does."""
    cfg = model.config
    name = type(model).__name__
    if name not in _ENCODERS:
        return f"it computes {', '.join(_ENCODERS)} only, not {name}"
    if getattr(cfg, "is_decoder", False):
        return "config is_decoder: causal attention"
    if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
        return f"config position_embedding_type {cfg.position_embedding_type!r}: only absolute positions"
    if not isinstance(cfg.hidden_act, str) or cfg.hidden_act not in _GELU:
        return f"config hidden_act {cfg.hidden_act!r}: only {', '.join(_GELU)}"
    return ""


class PackedBert:
    """Callable: list of Sequence -> (hidden [B, L, H] right-padded, mask [B, L])."""

    @classmethod
    def wrap(cls, model: torch.nn.Module, record: execution.ExecutionPlan,
             matmul_precision: str = "highest") -> PackedBert | None:
        """A PackedBert over model's weights, or None where it would not compute model's function
        (`unsupported` says why).

        record: the execution plan its paths are chosen in (linear, split_products, encoder_attention)."""
        return None if unsupported(model) else cls(model, record, matmul_precision)

    def __init__(self, model: torch.nn.Module, record: execution.ExecutionPlan, matmul_precision: str = "highest"):
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.approximate = _GELU[cfg.hidden_act]
        self.pad = cfg.pad_token_id if _ENCODERS[type(model).__name__] else None
        emb = model.embeddings
        self.word = emb.word_embeddings.weight
        self.position = emb.position_embeddings.weight
        self.token_type = emb.token_type_embeddings.weight
        self.emb_norm = emb.LayerNorm
        # Every projection as a linear_path.Projection: oneDNN-packed or plain F.linear per
        # row count, as timed at load for each weight shape (services/common/linear_path.py).
        # Per layer: fused Q/K/V, attention output, FFN up, FFN down as (weight, bias).
        weights = []
        for layer in model.encoder.layer:
            att = layer.attention.self
            qkv = (torch.cat([att.query.weight, att.key.weight, att.value.weight]),
                   torch.cat([att.query.bias, att.key.bias, att.value.bias]))
            dense = (layer.attention.output.dense, layer.intermediate.dense, layer.output.dense)
            weights.append([qkv] + [(m.weight, m.bias) for m in dense])
        plan = linear_path.plan((wb for layer in weights for wb in layer), record=record)
        self.linear_path = plan.summary   # reported by the Embedder's load log
        self.cpp_attention, self.attention = choose_attention(self.heads, cfg.hidden_size // self.heads,
                                                              self.word.dtype, record)
        self.layers = []
        for layer, projections in zip(model.encoder.layer, weights, strict=True):
            qkv, out, up, down = (linear_path.Projection(w, b, plan) for w, b in projections)
            self.layers.append((qkv, out, layer.attention.output.LayerNorm, up, down, layer.output.LayerNorm))
        # Under --matmul-precision high, fp32 projections on the tile unit where that beat the library at load.
        projections = [p for layer in self.layers for p in (layer[0], layer[1], layer[3], layer[4])]
        splits = split_products.choose([split_products.Target(p.weight, p.bias, p) for p in projections],
                                       record, matmul_precision)
        for projection, split in zip(projections, splits, strict=True):
            projection.split = split

    def _positions(self, ids: tuple[int, ...]) -> torch.Tensor:
        """One sequence's position ids: 0, 1, 2... for BERT; for RoBERTa what transformers'
        create_position_ids_from_input_ids gives: pad_token_id + the count of non-pad tokens so far, and
        pad_token_id itself at a pad token (token ids given by a caller may hold one)."""
        if self.pad is None:
            return torch.arange(len(ids))
        real = torch.tensor(ids).ne(self.pad).long()
        return real.cumsum(0) * real + self.pad

    def __call__(self, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        # Rows run sorted by length, so that each attention group is a contiguous token range; the
        # result is scattered back in the callers' order.
        order = sorted(range(len(seqs)), key=lambda r: len(seqs[r]))
        lengths = [len(seqs[r]) for r in order]
        batch, width = len(seqs), lengths[-1]
        ids = torch.tensor([t for r in order for t in seqs[r].ids])
        types = torch.tensor([t for r in order for t in (seqs[r].type_ids or (0,) * len(seqs[r]))])
        positions = torch.cat([self._positions(seqs[r].ids) for r in order])
        slots = torch.cat([torch.arange(n) + r * width for r, n in zip(order, lengths, strict=True)])  # [T] in B*L
        offsets = torch.tensor([0] + lengths).cumsum(0) if self.cpp_attention else None
        groups = [] if self.cpp_attention else _groups(lengths)
        x = self.word[ids] + self.position[positions] + self.token_type[types]
        x = self.emb_norm(x)                                                      # [T, H]
        for qkv_proj, out_proj, out_norm, up, down, ffn_norm in self.layers:
            qkv = qkv_proj(x)                                                     # [T, 3H]
            if self.cpp_attention:
                ctx = attention_cpu.attention(qkv, offsets, self.heads)           # [T, H]
            else:
                ctx = torch.empty_like(x)
                for group in groups:
                    group.attend(qkv, ctx, self.heads)
            x = out_norm(out_proj(ctx, residual=x))
            x = ffn_norm(down(up(x, gelu=self.approximate), residual=x))
        out = x.new_zeros(batch * width, x.shape[1])
        out[slots] = x
        mask = torch.arange(width).unsqueeze(0) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)   # [B, L]
        return out.view(batch, width, -1), mask
