"""nn.Linear with an optional oneDNN-packed copy of its weight, used by row count.

The projections and LM head are ~90% of a decode step on CPU. Whether the packed matmul
beats F.linear depends on the CPU and the number of rows (services/common/linear_path.py),
so `pack_linears` times both at load per weight shape and each Linear keeps the `Rule`
for its shape; forward picks the path from x.shape[0].

The module stays an nn.Linear with its dense `weight` (the adapter bank installs its slots
on q/k/v/o/gate/up/down_proj by name as `Linear.lora` and reads their shapes; the plain path reads it); the packed
tensor is an extra, opaque copy, kept only where some row count uses it. Under
`--quantization int8` (model/quantization.py) a Linear holds an int8 weight and per-row
scales instead, and its dense weight is released unless another module shares it (a tied
LM head's is the embedding table). `fuse` puts several projections of one input into one
Linear (Q/K/V, gate/up) and releases theirs.

How many rows each Linear runs on which kernel is chosen at load by measurement in
model/matmul_choice.py.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.common import linear_path, split_products
from services.common import plan as execution
from services.decoder.kernels import gemv_cpu, gemv_grouped_cpu
from services.decoder.model import grouped, quantization
from services.decoder.model.grouped import GroupedWeight, Int4Pack
from services.decoder.model.moe import Experts

log = logging.getLogger("tessera.linear")


class RowCorrection(Protocol):
    """What a projection adds to its base output row by row (the adapter bank's slots, lora/layer.py)."""

    def correct(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Linear):
    packed: torch.Tensor | None = None
    rule: linear_path.Rule | None = None
    qweight: torch.Tensor | None = None     # [out, in] int8 (quantization.quantize)
    qscale: torch.Tensor | None = None      # [out]
    grouped: GroupedWeight | None = None     # 4/8-bit groups (model/grouped.py) instead of a dense weight
    grouped_path: str = "dequant"            # its matmul above gemv_rows (choose_grouped_matmul)
    int4pack: Int4Pack | None = None         # torch's packing of `grouped`, where grouped_path is int4pack
    gemv_rows: int = 0                       # rows up to which gemv_cpu (gemv_grouped_cpu) runs (choose_gemv)
    int8_gemm: str = next(iter(quantization.GEMMS))  # the int8 weight's matmul above them (choose_int8_gemm)
    bf16_row: str = gemv_cpu.BF16_ROWS[0]    # its loop for bf16 x over a bf16 weight (choose_bf16_row)
    gemv_prefetch: bool = False              # the kernel asks for the weight ahead (choose_gemv_prefetch)
    gemv_streams: str = "one"                # its order over the weight rows, gemv_cpu.STREAMS (choose_gemv_streams)
    grouped_loop: str = gemv_grouped_cpu.WIDEST[0]  # the few-row kernel's loop over `grouped` (choose_grouped_loop)
    lora: RowCorrection | None = None        # each row's adapter correction, once an adapter bank installs it
    split: split_products.Split = split_products.Split()   # fp32 products split in bf16 halves (split_linears)

    @property
    def released(self) -> bool:
        """True once the weight moved elsewhere (fused, or quantized) and the dense copy was dropped."""
        return self.weight.numel() == 0

    def correct(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Base output y [N, out] of x [N, in] plus what `lora` adds to each row (nothing without an
        adapter bank). Lets a fused projection's slices be corrected."""
        lora = self.lora
        return y if lora is None else lora.correct(x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in_features] -> [N, out_features]."""
        if 0 < x.shape[0] <= self.gemv_rows:
            y = self.gemv(x)
        elif self.grouped is not None:
            y = grouped.grouped_linear(x, self.grouped, self.bias, self.grouped_path, self.int4pack)
        elif self.qweight is not None:
            y = quantization.GEMMS[self.int8_gemm](x, self.qweight, self.qscale, self.bias)
        elif self.split.takes(x.shape[0]):
            y = self.split(x, self.bias)
        else:
            y = self.library(x)
        lora = self.lora
        return y if lora is None else lora.correct(x, y)

    def library(self, x: torch.Tensor) -> torch.Tensor:
        """The dense weight's matmul by the library: oneDNN-packed where its rule says, else F.linear."""
        if self.packed is not None and self.rule.use_packed(x.shape[0]):
            return linear_path.packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def adopt(self, plan: linear_path.Plan) -> None:
        """Take plan's rule for this weight's shape; pack the weight if the rule ever uses it."""
        self.rule = plan.rule(self.weight, self.bias)
        self.packed = plan.pack(self.weight, self.bias) if self.rule.ever_packed else None

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """The few-row kernel over whichever weight this Linear holds (int8 with its scales, or grouped)."""
        if self.grouped is not None:
            return grouped.grouped_linear(x, self.grouped, self.bias, "gemv", loop=self.grouped_loop,
                                          prefetch=self.gemv_prefetch, streams=self.gemv_streams)
        if self.qweight is not None:
            return gemv_cpu.gemv(x, self.qweight, self.qscale, self.bias, prefetch=self.gemv_prefetch,
                                 streams=self.gemv_streams)
        return gemv_cpu.gemv(x, self.weight, None, self.bias, self.bf16_row, self.gemv_prefetch, self.gemv_streams)

    @torch.no_grad()
    def quantize(self, release: bool) -> None:
        """Switch to the int8 path; release: drop the dense weight (nothing else reads it)."""
        self.qweight, self.qscale = quantization.quantize(self.weight)
        if release:
            self.release()

    @torch.no_grad()
    def set_grouped(self, gw: GroupedWeight, release: bool = True, dtype: torch.dtype | None = None) -> None:
        """Hold gw (out_features x in_features, on CPU) as the weight: the grouped paths run from now on. release:
        replace the dense weight by an empty CPU tensor of `dtype` (default: the weight's), which stays the
        activations' dtype (a loader may call this on a Linear built on the meta device)."""
        if (gw.out_features, gw.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"grouped weight {gw.out_features}x{gw.in_features} for a "
                             f"{self.out_features}x{self.in_features} linear")
        self.grouped, self.grouped_path, self.int4pack = gw, "dequant", None
        if release:
            self.weight = nn.Parameter(torch.empty(0, dtype=dtype or self.weight.dtype), requires_grad=False)

    def release(self) -> None:
        """Drop the dense weight (in/out_features, dtype and device stay readable)."""
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


def fusible(parts: list[Linear]) -> bool:
    """Whether `fuse` can join parts: all dense or all grouped, with the same input width, dtype, device and bias
    presence. Grouped parts in different formats (a GGUF file's Q4_K_M keeps V in Q6_K beside Q4_K Q and K) are
    joined in the finest of them (common_format), exactly."""
    kinds = {(p.in_features, p.weight.dtype, p.weight.device, p.bias is None, p.grouped is None) for p in parts}
    return len(kinds) == 1 and all(p.grouped is not None or not p.released for p in parts)


def common_format(gws: list[GroupedWeight]) -> tuple[int, int]:
    """(bits, group) every one of gws can be held in exactly (grouped.regroup): the most bits, the smallest group
    (the groups are 16 or 32, so the smallest divides the others)."""
    return max(g.bits for g in gws), min(g.group for g in gws)


@torch.no_grad()
def fuse(parts: list[Linear]) -> Linear:
    """One Linear whose output is the parts' outputs side by side ([N, sum of out_features]);
    the parts' weights (dense or grouped) are released (they stay as modules: names, adapters, `correct`)."""
    first = parts[0]
    if not fusible(parts):
        raise ValueError("fused projections need the same input width, dtype, device and bias presence, and all "
                         "dense or all grouped weights")
    fused = Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                   device="meta")
    if first.grouped is None:
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    else:
        # Grouped rows are independent: the fused weight's codes, scales and offsets are the parts' stacked, each
        # part first held in the common format.
        bits, group = common_format([p.grouped for p in parts])
        gws = [grouped.regroup(p.grouped, bits, group) for p in parts]
        fused.weight = nn.Parameter(first.weight.new_empty(0), requires_grad=False)
        stacked = (torch.cat([getattr(g, f) for g in gws]) for f in ("codes", "scale", "offset"))
        fused.set_grouped(GroupedWeight(bits, group, fused.out_features, first.in_features, *stacked), release=False)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    for p in parts:
        p.grouped = None
        p.release()
    return fused


def quantize_linears(model: nn.Module, mode: str) -> str:
    """Quantize every eligible Linear of model (mode in quantization.MODES); a one-line summary
    for the log and GetModelInfo, e.g. "int8: 121 of 121 linears" or "none"."""
    if mode not in quantization.MODES:
        raise ValueError(f"quantization {mode!r}: choose from {', '.join(quantization.MODES)}")
    held = _held_grouped(model)
    if mode == "none":
        return held or "none"
    linears = [m for m in model.modules() if isinstance(m, Linear) and not m.released]
    devices = {m.weight.device.type for m in linears} - {"cpu"}
    if devices:
        raise ValueError(f"--quantization {mode} runs on CPU only (the weights are on {', '.join(sorted(devices))})")
    # A weight that some other module also holds (a tied LM head's embedding table) stays.
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    if mode == "int4":
        chosen = [m for m in linears if m.in_features % quantization.INT4_GROUP == 0]
        for m in chosen:
            m.set_grouped(grouped.quantize(m.weight, 4, quantization.INT4_GROUP), release=id(m.weight) not in shared)
        multiple = quantization.INT4_GROUP
        experts = sum(isinstance(m, Experts) for m in model.modules())
        rest = f"; experts of {experts} layers dense (int4 covers the linears)" if experts else ""
    else:
        chosen = [m for m in linears if quantization.eligible(m.weight)]
        for m in chosen:
            m.quantize(release=id(m.weight) not in shared)
        multiple, rest = quantization.K_MULTIPLE, _quantize_experts(model)
    left = f"; {len(linears) - len(chosen)} dense (in_features not a multiple of {multiple})" \
        if len(chosen) < len(linears) else ""
    return f"{mode}: {len(chosen)} of {len(linears)} linears{left}{rest}" + (f"; {held}" if held else "")


def _held_grouped(model: nn.Module) -> str:
    """The grouped weights a model was loaded with (a GGUF file's quantized matrices, model/gguf_file.py), for the
    summary: e.g. "gguf: 45 linears grouped (30 int4/g32, 15 int8/g16)"; "" when none."""
    kinds = Counter(m.grouped.describe() for m in model.modules() if isinstance(m, Linear) and m.grouped is not None)
    if not kinds:
        return ""
    return (f"gguf: {sum(kinds.values())} linears grouped "
            f"({', '.join(f'{n} {kind}' for kind, n in sorted(kinds.items()))})")


def _quantize_experts(model: nn.Module) -> str:
    """Quantize the experts of a mixture-of-experts model (model/moe.py); what to add to the summary."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        return ""
    chosen = [m for m in experts if Experts.eligible(m.down_proj.shape[1], m.size)]
    for m in chosen:
        m.quantize()
    left = f" ({len(experts) - len(chosen)} dense: widths not multiples of {quantization.K_MULTIPLE})" \
        if len(chosen) < len(experts) else ""
    return f"; experts of {len(chosen)} of {len(experts)} layers{left}"


def pack_linears(model: nn.Module, record: execution.ExecutionPlan) -> str:
    """Choose the matmul path per weight shape of every dense Linear of model (the `linear` path of
    record: auto times them; see linear_path.MODES) and pack where used. Returns the one-line summary."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and not m.released and m.qweight is None
               and m.grouped is None]
    if not linears:
        record.record("linear", "none", reason="every linear is quantized")
        return "none: every linear is quantized"
    plan = linear_path.plan(((m.weight, m.bias) for m in linears), record=record)
    for m in linears:
        m.adopt(plan)
    return plan.summary


def split_linears(model: nn.Module, record: execution.ExecutionPlan, precision: str) -> None:
    """Under --matmul-precision high, each dense fp32 Linear's products split in bf16 halves from the rows where
    that beat its library path at load (services/common/split_products.py); after pack_linears."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and not m.released and m.qweight is None
               and m.grouped is None]
    targets = [split_products.Target(m.weight, m.bias, m.library) for m in linears]
    for m, split in zip(linears, split_products.choose(targets, record, precision), strict=True):
        m.split = split
