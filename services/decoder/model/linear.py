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

A decode step of a few rows reads every weight once; for it kernels/gemv_cpu.cpp streams each
weight row once for all rows. `choose_gemv` times it against the Linear's own path over every
module of a shape (as a forward would stream them, not one weight hot in cache) at 1..4 rows,
and each Linear keeps `gemv_rows`: up to how many rows the kernel runs. For bf16 activations over bf16
weights the kernel has two loops (gemv_cpu.BF16_ROWS) whose speed depends on the CPU; `choose_bf16_row`
times both over the model's weights and each Linear keeps `bf16_row`. Above `gemv_rows` an int8 weight runs
one of quantization.GEMMS, `int8_gemm`, which `choose_int8_gemm` times per shape at many rows.

A Linear may instead hold a grouped 4/8-bit weight (model/grouped.py: `--quantization int4`, or a GGUF
file's blocks through `set_grouped`): few rows run kernels/gemv_grouped_cpu (choose_gemv times it as it
times gemv_cpu), more rows the weight dequantized for the library matmul or torch's own 4-bit kernel,
whichever `choose_grouped_matmul` measured faster at load for the shape (`grouped_path`).
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.common import linear_path, native
from services.common import plan as execution
from services.decoder.kernels import gemv_cpu, gemv_grouped_cpu
from services.decoder.model import grouped, moe, quantization
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
    lora: RowCorrection | None = None        # each row's adapter correction, once an adapter bank installs it

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
        packed = self.packed
        if 0 < x.shape[0] <= self.gemv_rows:
            y = self.gemv(x)
        elif self.grouped is not None:
            y = grouped.grouped_linear(x, self.grouped, self.bias, self.grouped_path, self.int4pack)
        elif self.qweight is not None:
            y = quantization.GEMMS[self.int8_gemm](x, self.qweight, self.qscale, self.bias)
        elif packed is not None and self.rule.use_packed(x.shape[0]):
            y = linear_path.packed_linear(x, packed, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        lora = self.lora
        return y if lora is None else lora.correct(x, y)

    def adopt(self, plan: linear_path.Plan) -> None:
        """Take plan's rule for this weight's shape; pack the weight if the rule ever uses it."""
        self.rule = plan.rule(self.weight, self.bias)
        self.packed = plan.pack(self.weight, self.bias) if self.rule.ever_packed else None

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """The few-row kernel over whichever weight this Linear holds (int8 with its scales, or grouped)."""
        if self.grouped is not None:
            return grouped.grouped_linear(x, self.grouped, self.bias, "gemv")
        if self.qweight is not None:
            return gemv_cpu.gemv(x, self.qweight, self.qscale, self.bias)
        return gemv_cpu.gemv(x, self.weight, None, self.bias, self.bf16_row)

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
    """Whether `fuse` can join parts: all dense, or all grouped in one format (bits, group), with the same input
    width, dtype, device and bias presence. A GGUF file may store Q, K and V in different types (Q4_K_M keeps
    V in Q6_K): those stay three matmuls."""
    kinds = {(p.in_features, p.weight.dtype, p.weight.device, p.bias is None,
              None if p.grouped is None else (p.grouped.bits, p.grouped.group)) for p in parts}
    return len(kinds) == 1 and all(p.grouped is not None or not p.released for p in parts)


@torch.no_grad()
def fuse(parts: list[Linear]) -> Linear:
    """One Linear whose output is the parts' outputs side by side ([N, sum of out_features]);
    the parts' weights (dense or grouped) are released (they stay as modules: names, adapters, `correct`)."""
    first = parts[0]
    if not fusible(parts):
        raise ValueError("fused projections need the same input width, dtype, device, bias presence and weight "
                         "format")
    fused = Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                   device="meta")
    if first.grouped is None:
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    else:
        # Grouped rows are independent: the fused weight's codes, scales and offsets are the parts' stacked.
        gws = [p.grouped for p in parts]
        fused.weight = nn.Parameter(first.weight.new_empty(0), requires_grad=False)
        fused.set_grouped(GroupedWeight(first.grouped.bits, first.grouped.group, fused.out_features,
                                        first.in_features, *(torch.cat([getattr(g, f) for g in gws])
                                                             for f in ("codes", "scale", "offset"))), release=False)
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


# Row counts at which choose_int8_gemm times the int8 matmuls: a mid-size and a large decode batch.
INT8_GEMM_ROWS = (32, 128)
# A weight with more output rows is timed on its first INT8_GEMM_OUT (a view, no copy): beyond a few of
# the GEMMs' column blocks every path's time grows in proportion to the outputs, and a 49152-row LM head
# then costs the timing no more than a layer's MLP weight.
INT8_GEMM_OUT = 3072
# Passes over every (shape, rows), each of INT8_GEMM_REPS interleaved rounds; the fastest of all passes
# counts. A burst of other load on a shared machine (seen: every path 20-80x slower for a whole 32-row
# round, which kept int8pack on the largest shape) then spans one pass, not all of them.
INT8_GEMM_PASSES, INT8_GEMM_REPS = 3, 2

# (a Linear with an int8 weight, rows) -> {quantization.GEMMS name: seconds for one call at `rows` rows}.
Int8GemmTimer = Callable[[Linear, int], dict[str, float]]


@torch.inference_mode()
def time_int8_gemm(m: Linear, rows: int) -> dict[str, float]:
    """Each of quantization.GEMMS over m's int8 weight (its first INT8_GEMM_OUT rows) at `rows` rows of m's
    dtype, by the plan's timer."""
    q, scale = m.qweight[:INT8_GEMM_OUT], m.qscale[:INT8_GEMM_OUT]
    bias = None if m.bias is None else m.bias[:INT8_GEMM_OUT]
    x = torch.randn(rows, m.in_features, dtype=m.weight.dtype)
    return execution.fastest({name: (lambda f=f: f(x, q, scale, bias)) for name, f in quantization.GEMMS.items()},
                             reps=INT8_GEMM_REPS)


def choose_int8_gemm(model: nn.Module, record: execution.ExecutionPlan, timer: Int8GemmTimer | None = None) -> str:
    """Set int8_gemm on every Linear of model that holds an int8 weight (the `int8_gemm` path of record):
    pinned, that matmul everywhere; auto, per (out, in, bias) shape, each of quantization.GEMMS timed at
    INT8_GEMM_ROWS rows on one module of the shape (fastest of INT8_GEMM_PASSES passes over all shapes), and
    the one with the least time per row summed over those counts kept if it beats the default (plan.pick):
    one matmul for every row count above the few-row kernel's. A summary such as
    "int8 gemm: dequant on 960x576,576x576; int8pack on 49152x576"."""
    name, candidates = "int8_gemm", execution.PATHS["int8_gemm"]
    pin = record.pinned(name)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    if not linears:
        if pin != execution.AUTO:
            record.record(name, pin, reason=f"pinned by --fast-paths {name}={pin}; no int8 weights")
        return "int8 gemm: none (no int8 weights)"
    if pin != execution.AUTO:
        for m in linears:
            m.int8_gemm = pin
        record.record(name, pin)
        return f"int8 gemm: {pin} on every shape (--fast-paths {name}={pin})"
    timer = timer or time_int8_gemm
    groups: dict[tuple[int, int, bool], list[Linear]] = {}
    for m in linears:
        groups.setdefault((m.out_features, m.in_features, m.bias is not None), []).append(m)
    best = {key: {rows: dict.fromkeys(candidates, math.inf) for rows in INT8_GEMM_ROWS} for key in groups}
    for _ in range(INT8_GEMM_PASSES):
        for key, group in groups.items():
            for rows in INT8_GEMM_ROWS:
                for c, seconds in timer(group[0], rows).items():
                    best[key][rows][c] = min(best[key][rows][c], seconds)
    chosen: dict[str, list[str]] = {}
    for (out, inp, bias), group in groups.items():
        shape, at = f"{out}x{inp}{'+b' if bias else ''}", best[(out, inp, bias)]
        timings = [execution.Timing(c, at[rows][c], rows) for rows in INT8_GEMM_ROWS for c in candidates]
        pick = execution.pick({c: sum(at[rows][c] / rows for rows in INT8_GEMM_ROWS) for c in candidates},
                              candidates[0])
        for m in group:
            m.int8_gemm = pick
        timed = f"first {INT8_GEMM_OUT} of {out} rows" if out > INT8_GEMM_OUT else "whole weight"
        record.record(f"{name} {shape}", pick, timings, reason=f"timed, {timed}")
        chosen.setdefault(pick, []).append(shape)
    return "int8 gemm: " + "; ".join(f"{pick} on {','.join(shapes)}" for pick, shapes in chosen.items())


def _timed_rows(group: list, timer: GemvTimer, record: execution.ExecutionPlan, name: str) -> int:
    """Time group (modules of one shape) at 1..MAX_ROWS rows; set and record (as name) their gemv_rows."""
    best = {r: [math.inf, math.inf] for r in range(1, gemv_cpu.MAX_ROWS + 1)}
    # A first pass, discarded. In a fresh process it once kept a 49152x576 bf16 LM head off gemv_cpu,
    # which then ran it at 1 row in 1.4-1.7 ms against the library's 1.9-2.4 (Zen 4, 2 threads); the
    # packed copy pack_linears has just written is likely still partly in L3 for its first call.
    for r in best:
        timer(group, r)
    for _ in range(GEMV_PASSES):
        for r in best:
            own, kernel = timer(group, r)
            best[r] = [min(best[r][0], own), min(best[r][1], kernel)]
    rows = 0
    while rows < gemv_cpu.MAX_ROWS and execution.beats(best[rows + 1][1], best[rows + 1][0]):
        rows += 1
    for m in group:
        m.gemv_rows = rows
    timings = [execution.Timing(path, t, r) for r, (o, k) in best.items() for path, t in (("off", o), ("on", k))]
    record.record(name, f"on rows<={rows}" if rows else "off", timings)
    return rows


# (modules of one shape, rows) -> (seconds on their own path, seconds on gemv_cpu) for one pass over all of them.
GemvTimer = Callable[[list[Linear], int], tuple[float, float]]
GEMV_PASSES = 3


@torch.inference_mode()
def time_gemv(group: list[Linear], rows: int) -> tuple[float, float]:
    """One pass of each path over every module in group at `rows` rows: (own path s, gemv s); the
    passes of choose_gemv are the plan timer's rounds (the first, discarded, its warm-up)."""
    x = torch.randn(rows, group[0].in_features, dtype=group[0].weight.dtype)
    for m in group:
        m.gemv_rows = 0

    def own():
        for m in group:
            m(x)

    def kernel():
        for m in group:
            m.gemv(x)
    best = execution.fastest({"own": own, "gemv": kernel}, reps=1, warm=False)
    return best["own"], best["gemv"]


def choose_gemv(model: nn.Module, record: execution.ExecutionPlan, timer: GemvTimer | None = None,
                expert_timer: GemvTimer | None = None) -> str:
    """Set gemv_rows on every CPU Linear of model (the `gemv` path of record), and on a mixture of experts'
    experts (model/moe.py): pinned on, MAX_ROWS; off, 0; auto, from timings (fastest of GEMV_PASSES passes per
    shape and row count): the largest r such that gemv_cpu beats the library path (plan.beats) at every row
    count <= r, one choice per shape. A summary such as "gemv rows<=4 on 960x576,576x576; rows<=1 on
    49152x576", or why not."""
    pin = record.pinned("gemv")
    linears = [m for m in model.modules() if isinstance(m, Linear)
               and (m.qweight is not None or m.grouped is not None or not m.released)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    for m in linears + experts:
        m.gemv_rows = 0
    experts = [m for m in experts if m.down_scale is not None or (m.down_proj.device.type == "cpu"
                                                                  and m.down_proj.dtype in gemv_cpu.WEIGHT_DTYPES)]
    # A grouped weight's activations (the released weight's dtype) must be ones its kernel takes.
    linears = [m for m in linears if m.weight.device.type == "cpu" and (
        m.qweight is not None or m.weight.dtype in (gemv_grouped_cpu.ACT_DTYPES if m.grouped is not None
                                                    else gemv_cpu.WEIGHT_DTYPES))]
    if pin == "off":
        record.record("gemv", "off")
        return "gemv: off (--fast-paths gemv=off)"
    if not linears:
        if pin == "on":
            raise ValueError("--fast-paths gemv=on: the model has no CPU weights the few-row kernel takes")
        record.record("gemv", "off", reason="no CPU weights")
        return "gemv: none (no CPU weights)"
    try:
        gemv_cpu.load()
        if any(m.grouped is not None for m in linears):
            gemv_grouped_cpu.load()
    except native.BuildError as e:
        if pin == "on":
            raise
        log.warning("gemv_cpu unavailable, few-row matmuls use the library path: %s", e)
        record.record("gemv", "off", reason=f"unavailable: {str(e).splitlines()[0]}", level=logging.WARNING)
        return f"gemv: unavailable ({str(e).splitlines()[0]})"
    if pin == "on":
        for m in linears + experts:
            m.gemv_rows = gemv_cpu.MAX_ROWS
        record.record("gemv", f"on rows<={gemv_cpu.MAX_ROWS}")
        return f"gemv rows<={gemv_cpu.MAX_ROWS} on every shape (--fast-paths gemv=on)"
    timer = timer or time_gemv
    groups: dict[tuple, list[Linear]] = {}
    for m in linears:
        kind = " int8" if m.qweight is not None else f" {m.grouped.describe()}" if m.grouped is not None else ""
        key = (m.out_features, m.in_features, kind, m.weight.dtype, m.bias is not None)
        groups.setdefault(key, []).append(m)
    chosen: dict[int, list[str]] = {}
    for (out, inp, kind, _, bias), group in groups.items():
        rows = _timed_rows(group, timer, record,
                           # Named as linear_path names shapes, so that two groups of one size stay two choices.
                           f"gemv {out}x{inp}{'+b' if bias else ''}{kind}")
        chosen.setdefault(rows, []).append(f"{out}x{inp}")
    shapes: dict[tuple, list[Experts]] = {}
    for m in experts:
        shapes.setdefault((m.num_experts, m.size, m.hidden, m.quantized, m.dtype), []).append(m)
    for (count, size, hidden, int8, _), group in shapes.items():
        name = f"experts {count}x{2 * size}x{hidden}{' int8' if int8 else ''}"
        rows = _timed_rows(group, expert_timer or moe.time_gemv, record, f"gemv {name}")
        chosen.setdefault(rows, []).append(name)
    body = "; ".join(f"rows<={r} on {','.join(shapes)}" for r, shapes in sorted(chosen.items(), reverse=True) if r)
    return f"gemv {body}" if body else "gemv: none (the library path was as fast at every shape)"


# (modules, rows) -> {loop: seconds for one pass of gemv_cpu over every module at `rows` rows}.
Bf16RowTimer = Callable[[list[Linear], int], dict[str, float]]


@torch.inference_mode()
def time_bf16_row(group: list[Linear], rows: int) -> dict[str, float]:
    """Each of gemv_cpu.BF16_ROWS over every module in group at `rows` bf16 rows, as a decode step streams
    the weights (one after the other, not one weight hot in cache), by the plan's timer."""
    xs = {m.in_features: torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in group}

    def one_pass(loop: str) -> None:
        for m in group:
            gemv_cpu.gemv(xs[m.in_features], m.weight, None, m.bias, loop)
    return execution.fastest({loop: (lambda loop=loop: one_pass(loop)) for loop in gemv_cpu.BF16_ROWS})


def choose_bf16_row(model: nn.Module, record: execution.ExecutionPlan, timer: Bf16RowTimer | None = None) -> str:
    """Set bf16_row on every Linear of a bf16 model whose bf16 weight runs gemv_cpu (after choose_gemv;
    the `gemv_bf16_row` path of record). Pinned: that loop. Auto: one pass over all of them per loop and
    row count (the plan's timer: fastest of REPS interleaved rounds), and interleave4 replaces the default
    rowwise only where it beats it (plan.beats) at one row and no row count beats it: one loop for every
    row count, so a row's sums do not depend on the batch. The chosen loop, or why rowwise."""
    default, challenger = execution.PATHS["gemv_bf16_row"]
    pin = record.pinned("gemv_bf16_row")
    group = [m for m in model.modules() if isinstance(m, Linear) and m.gemv_rows and m.qweight is None
             and m.grouped is None and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    chosen, timings, reason = default if pin == execution.AUTO else pin, [], ""
    if not group:
        reason = "no bf16 weight runs the few-row kernel"
    elif not gemv_cpu.load().bf16_dot():
        reason = "no bf16 dot product on this CPU: both loops widen to the fp32 one"
    elif pin == execution.AUTO:
        timer = timer or time_bf16_row
        wins: dict[int, bool] = {}
        for rows in range(1, max(m.gemv_rows for m in group) + 1):
            at = [m for m in group if m.gemv_rows >= rows]
            best = timer(at, rows)
            timings += [execution.Timing(loop, best[loop], rows) for loop in (default, challenger)]
            wins[rows] = execution.beats(best[challenger], best[default]) or \
                (rows > 1 and not execution.beats(best[default], best[challenger]))
        chosen = challenger if all(wins.values()) else default
        reason = f"timed over {len(group)} bf16 weights"
    if pin != execution.AUTO:
        reason = f"pinned by --fast-paths gemv_bf16_row={pin}" + (f"; {reason}" if reason else "")
    for m in group:
        m.bf16_row = chosen
    record.record("gemv_bf16_row", chosen, timings, reason)
    return f"gemv bf16 loop: {chosen} ({reason})"


# (modules of one shape, each path's call over all of them) -> {path: seconds for one pass}.
GroupedTimer = Callable[[list[Linear], dict[str, Callable[[], object]]], dict[str, float]]
# Rows of x the many-row paths are timed at: a prefill chunk's order of magnitude, above the few-row kernel.
GROUPED_ROWS = 64


def _grouped_calls(group: list[Linear], paths: tuple[str, ...]) -> dict[str, Callable[[], object]]:
    x = torch.randn(GROUPED_ROWS, group[0].in_features, dtype=group[0].weight.dtype)

    def one_pass(path: str) -> None:
        for m in group:
            grouped.grouped_linear(x, m.grouped, m.bias, path, m.int4pack)
    return {path: (lambda path=path: one_pass(path)) for path in paths}


@torch.inference_mode()
def time_grouped(group: list[Linear], calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each path's pass over every module in group (as a prefill streams them), by the plan's timer."""
    return execution.fastest(calls)


def choose_grouped_matmul(model: nn.Module, record: execution.ExecutionPlan, timer: GroupedTimer | None = None) -> str:
    """Set grouped_path (and int4pack) on every Linear holding a grouped weight, per shape (the `grouped_matmul`
    path of record): pinned, that path where the weight fits it (int4pack: grouped.int4pack_fits; else dequant);
    auto, int4pack where it fits and beats dequant (plan.beats) at GROUPED_ROWS rows. A summary."""
    default, challenger = execution.PATHS["grouped_matmul"]
    pin = record.pinned("grouped_matmul")
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.grouped is not None]
    if not linears:
        record.record("grouped_matmul", default, reason="no grouped weights")
        return "grouped matmul: none (no grouped weights)"
    shapes: dict[tuple, list[Linear]] = {}
    for m in linears:
        gw = m.grouped
        shapes.setdefault((gw.out_features, gw.in_features, gw.describe(), m.weight.dtype, m.bias is not None),
                          []).append(m)
    fits = {key: grouped.int4pack_fits(group[0].grouped) for key, group in shapes.items()}
    if pin == challenger and not any(fits.values()):
        raise ValueError(f"--fast-paths grouped_matmul={challenger}: no grouped weight fits torch's 4-bit kernel "
                         f"(4-bit, groups of {grouped.INT4PACK_GROUP}, "
                         f"out_features a multiple of {grouped.INT4PACK_N})")
    chosen: dict[str, list[str]] = {}
    for (out, inp, kind, dtype, bias), group in shapes.items():
        name = f"grouped_matmul {out}x{inp}{'+b' if bias else ''} {kind}"
        timings, reason = [], ""
        if not fits[(out, inp, kind, dtype, bias)]:
            path, reason = default, "torch's 4-bit kernel does not take this weight"
        else:
            for m in group:
                m.int4pack = grouped.int4pack(m.grouped, dtype)
            if pin != execution.AUTO:
                path, reason = pin, f"pinned by --fast-paths grouped_matmul={pin}"
            else:
                best = (timer or time_grouped)(group, _grouped_calls(group, (default, challenger)))
                timings = [execution.Timing(p, best[p], GROUPED_ROWS) for p in (default, challenger)]
                path = challenger if execution.beats(best[challenger], best[default]) else default
        for m in group:
            m.grouped_path = path
            if path != challenger:
                m.int4pack = None
        record.record(name, path, timings, reason)
        chosen.setdefault(path, []).append(f"{out}x{inp}")
    return "grouped matmul " + "; ".join(f"{p} on {','.join(s)}" for p, s in chosen.items())
