"""The mixture-of-experts layer: a router picks top_k experts per row, and only those experts' weights are read.

Routing (`Router`) repeats transformers' TopKRouter of each family op for op: the logits x @ W^T in the
activations' dtype, softmax in fp32, top-k, then the family's rule (model/moe_config.py): Qwen divides the
top-k probabilities by their sum only under norm_topk_prob and rounds them to the activations' dtype,
Mixtral always divides and keeps them fp32 until they scale the expert's output.

Dispatch (`Experts`): the weights are stacked as transformers 5 holds them, gate|up [E, 2I, H] and down
[E, H, I], so one expert's gate|up is one contiguous [2I, H] matrix and its down one [H, I]. The step's
(row, choice) pairs are sorted by expert id; each expert that has rows runs one gate|up and one down matmul
over exactly its rows, so an expert no row chose is never read (a batch-1 decode step reads top_k experts).
Each output row is multiplied by its routing weight and written back at its (row, choice) place, and a
row's top_k results are summed, as transformers' default (grouped) experts path sums them: in the dtype of
output * weight, then rounded to the activations' dtype.

A few rows (a decode step) may run each chosen expert's two matmuls by kernels/gemv_cpu.cpp instead of the
library's, up to `gemv_rows` rows, chosen by timing at load with the Linears' (model/matmul_choice.py, choose_gemv;
`time_gemv` here times the experts as a decode step reads them).

Under `--quantization int8` the experts are quantized like a Linear (model/quantization.py): per output
row of every expert, the int8 kernel over the chosen experts' slices. The router stays dense: an int8
router would route tokens to other experts than the checkpoint's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.common import plan as execution
from services.decoder.kernels import gemv_cpu, glue_cpu
from services.decoder.model import quantization
from services.decoder.model.moe_config import MoeConfig


@dataclass(frozen=True)
class Routing:
    """Each row's chosen experts and their weights."""

    experts: torch.Tensor       # [N, top_k] int64 expert ids, in descending probability
    weights: torch.Tensor       # [N, top_k] fp32 (Mixtral) or the activations' dtype (Qwen)


class Router(nn.Module):
    """`mlp.gate` of a checkpoint: weight [E, H]."""

    def __init__(self, hidden: int, moe: MoeConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.top_k, self.norm_topk, self.weights_fp32 = moe.top_k, moe.norm_topk, moe.weights_fp32

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, H] -> the routing of every row."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(ids, top if self.weights_fp32 else top.to(logits.dtype))


class Experts(nn.Module):
    """`mlp.experts` of a checkpoint: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, hidden: int, moe: MoeConfig):
        super().__init__()
        self.num_experts, self.size, self.top_k = moe.num_experts, moe.expert_size, moe.top_k
        self.gemv_rows = 0      # rows up to which gemv_cpu runs the matmuls (model/matmul_choice.py, choose_gemv)
        self.hidden = hidden
        self.act_dtype: torch.dtype | None = None      # the activations' dtype, kept by quantize
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.expert_size, hidden))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden, moe.expert_size))
        self.native = False     # SiLU(gate) * up by the C++ row op (kernels/glue_cpu); set by model/glue.py
        # int8 (quantize): weights [E, out, in] and per-row scales [E, out], parameters so that
        # CausalLM.place_weights moves them with the rest.
        self.gate_up_q: nn.Parameter | None = None
        self.gate_up_scale: nn.Parameter | None = None
        self.down_q: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None

    @property
    def quantized(self) -> bool:
        return self.gate_up_q is not None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype."""
        return self.act_dtype if self.quantized else self.gate_up_proj.dtype

    @staticmethod
    def eligible(hidden: int, size: int) -> bool:
        """Whether both matmuls' inner widths suit the int8 kernel (quantization.K_MULTIPLE)."""
        return hidden % quantization.K_MULTIPLE == 0 and size % quantization.K_MULTIPLE == 0

    @torch.no_grad()
    def quantize(self) -> None:
        """Switch to int8 weights (each expert's rows scaled as quantization.quantize scales a Linear's) and
        release the dense ones."""
        self.act_dtype = self.gate_up_proj.dtype
        for name in ("gate_up", "down"):
            w = getattr(self, f"{name}_proj")
            e, out, inp = w.shape
            q, scale = quantization.quantize(w.reshape(e * out, inp))
            setattr(self, f"{name}_q", nn.Parameter(q.view(e, out, inp), requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale.view(e, out), requires_grad=False))
            setattr(self, f"{name}_proj", nn.Parameter(w.new_empty(0), requires_grad=False))

    def _matmul(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """x [M, in] -> [M, out] through expert e's `name` ("gate_up" or "down") weight."""
        few = 0 < x.shape[0] <= self.gemv_rows
        if self.quantized:
            q, scale = getattr(self, f"{name}_q")[e], getattr(self, f"{name}_scale")[e]
            return gemv_cpu.gemv(x, q, scale, None) if few else quantization.int8_linear(x, q, scale, None)
        w = getattr(self, f"{name}_proj")[e]
        return gemv_cpu.gemv(x, w, None, None) if few else F.linear(x, w)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x [M, H] -> expert e's SiLU-gated MLP of it [M, H]; reads only expert e's weights."""
        gate, up = self._matmul(x, "gate_up", e).chunk(2, dim=1)
        h = glue_cpu.silu_mul(gate, up) if self.native else F.silu(gate) * up
        return self._matmul(h, "down", e)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [N, H], each row's routing -> sum over its top_k experts of weight * expert(row), [N, H]."""
        n, k = routing.experts.shape
        weights = routing.weights.reshape(-1)
        if n == 1:
            # One row (a batch-1 decode step): its k experts in turn, no sort.
            outs = [self.expert(x, e) * weights[j] for j, e in enumerate(routing.experts[0].tolist())]
            return torch.cat(outs).sum(dim=0, keepdim=True).to(x.dtype)
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)               # (row, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, order // k)
        out = None
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]
            y = self.expert(rows[start:start + count], e) * weights.index_select(0, pairs)[:, None]
            if out is None:
                out = y.new_empty(n * k, y.shape[1])
            out.index_copy_(0, pairs, y)
            start += count
        return out.view(n, k, -1).sum(dim=1).to(x.dtype)


@torch.inference_mode()
def time_gemv(group: list[Experts], rows: int) -> tuple[float, float]:
    """One pass over every module of group, top_k expert calls of `rows` rows each, on experts the previous
    pass did not read (as a decode step streams them, not a few hot in cache): (library s, gemv_cpu s)."""
    first = group[0]
    x = torch.randn(rows, first.hidden).to(first.dtype)
    passes = [0]

    def run(gemv_rows: int) -> None:
        start = passes[0] * first.top_k
        passes[0] += 1
        for m in group:
            m.gemv_rows = gemv_rows
            for j in range(m.top_k):
                m.expert(x, (start + j) % m.num_experts)
            m.gemv_rows = 0
    best = execution.fastest({"own": lambda: run(0), "gemv": lambda: run(gemv_cpu.MAX_ROWS)}, reps=1, warm=False)
    return best["own"], best["gemv"]
