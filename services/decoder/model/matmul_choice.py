"""The matmul paths of the Linears (model/linear.py), chosen per weight shape at load by measurement and
recorded in the execution plan (services/common/plan.py); `--fast-paths` pins each.

A decode step of a few rows reads every weight once; for it kernels/gemv_cpu.cpp streams each
weight row once for all rows. `choose_gemv` times it against the Linear's own path over every
module of a shape (as a forward would stream them, not one weight hot in cache) at 1..4 rows,
and each Linear keeps `gemv_rows`: up to how many rows the kernel runs. For bf16 activations over bf16
weights the kernel has two loops (gemv_cpu.BF16_ROWS) whose speed depends on the CPU; `choose_bf16_row`
times both over the model's weights and each Linear keeps `bf16_row`; `choose_gemv_prefetch` times the kernel
with and without asking for the weights ahead of the row it reads, and each keeps `gemv_prefetch`;
`choose_gemv_streams` times each thread reading its weight rows front to back and from two halves of its share
in turn, and each keeps `gemv_streams`. Above
`gemv_rows` an int8 weight runs one of quantization.GEMMS, `int8_gemm`, which `choose_int8_gemm` times per shape
at many rows.

A Linear may instead hold a grouped 4/8-bit weight (model/grouped.py: `--quantization int4`, or a GGUF
file's blocks through `set_grouped`): few rows run kernels/gemv_grouped_cpu (choose_gemv times it as it
times gemv_cpu), more rows the weight dequantized for the library matmul, torch's own 4-bit kernel, or the
weight widened block by block in cache (kernels/widen_gemm_cpu), whichever `choose_grouped_matmul` measured
fastest at load for the shape (`grouped_path`).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from services.common import native
from services.common import plan as execution
from services.decoder.kernels import gemv_cpu, gemv_grouped_cpu, widen_gemm_cpu
from services.decoder.model import grouped, moe, quantization
from services.decoder.model.linear import Linear
from services.decoder.model.moe import Experts

log = logging.getLogger("tessera.linear")


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
    return execution.fastest({name: (lambda f=f: f(x, q, scale, bias))
                              for name, f in quantization.usable_gemms(x.dtype).items()}, reps=INT8_GEMM_REPS)


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
    dtype = linears[0].weight.dtype
    usable = quantization.usable_gemms(dtype)
    if pin != execution.AUTO and pin not in usable:
        raise ValueError(f"--fast-paths {name}={pin}: {quantization.unusable(pin, dtype)}; pin int8pack or dequant")
    candidates = tuple(c for c in candidates if c in usable)
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
                    if c in candidates:
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
        # A lead of DECISIVE at every row count in a timed pass is not noise: the later passes are skipped,
        # so a model of large grouped weights (whose own path rebuilds the whole float weight per call,
        # 25-70x slower at 4 rows on a 1B model) is not timed over every layer twice more.
        if all(k * DECISIVE < o or o * DECISIVE < k for o, k in best.values()):
            break
    # The kernel runs rows 1..r (one threshold: a row's sums then change only where the batch crosses it). First
    # the largest r where it beats the library (plan.beats) at every count up to r; then the r with the least time
    # over one call at each of 1..MAX_ROWS rows replaces it if that beats it: a near tie at 2 rows then no longer
    # keeps the library at 3-4 rows where the kernel is 3x faster (Intel Xeon family 6 model 167: 576x576 at
    # 4 rows 0.96 ms against 2.89).
    every = 0
    while every < gemv_cpu.MAX_ROWS and execution.beats(best[every + 1][1], best[every + 1][0]):
        every += 1
    total = [sum(best[r][1] if r <= cut else best[r][0] for r in best) for cut in range(gemv_cpu.MAX_ROWS + 1)]
    rows = min(range(len(total)), key=total.__getitem__)
    rows = rows if execution.beats(total[rows], total[every]) else every
    for m in group:
        m.gemv_rows = rows
    timings = [execution.Timing(path, t, r) for r, (o, k) in best.items() for path, t in (("off", o), ("on", k))]
    record.record(name, f"on rows<={rows}" if rows else "off", timings)
    return rows


# (modules of one shape, rows) -> (seconds on their own path, seconds on gemv_cpu) for one pass over all of them.
GemvTimer = Callable[[list[Linear], int], tuple[float, float]]
GEMV_PASSES = 3
# How many times faster one path must be at every row count for the first pass to decide (see _timed_rows).
DECISIVE = 4.0


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
    shape and row count): gemv_cpu at rows 1..r, r the largest count up to which it beats the library path
    (plan.beats) at every count, or the r with the least time summed over 1..MAX_ROWS rows where that beats the
    first's sum; one choice per shape. A summary such as "gemv rows<=4 on 960x576,576x576; rows<=1 on
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
    """Set bf16_row on every Linear of a bf16 model whose bf16 weight runs gemv_cpu (after choose_gemv; the
    `gemv_bf16_row` path of record), by _choose_row_loop. The chosen loop, or why rowwise."""
    group = [m for m in model.modules() if isinstance(m, Linear) and m.gemv_rows and m.qweight is None
             and m.grouped is None and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    unavailable = "" if not group or gemv_cpu.load().bf16_dot() else \
        "no bf16 dot product on this CPU: both loops widen to the fp32 one"
    chosen, reason = _choose_row_loop(record, "gemv_bf16_row", group, "bf16 weight", timer or time_bf16_row,
                                      lambda m: m.gemv_rows, unavailable)
    for m in group:
        m.bf16_row = chosen
    return f"gemv bf16 loop: {chosen} ({reason})"


# The ways the few-row kernel reads the weights, each a path of the plan timed by _choose_reading: the path's
# candidates' values of the Linear attribute it sets (the kernel's reading: gemv_cpu.reading).
READINGS: dict[str, dict[str, object]] = {
    "gemv_prefetch": {"off": False, "on": True},
    "gemv_streams": {name: name for name in gemv_cpu.STREAMS},
}


def time_gemv_reading(path: str) -> Bf16RowTimer:
    """The plan's timer for a path of READINGS: per candidate, its value set on every module of a group and one
    pass over them at `rows` rows (of a dense weight's dtype; fp32 over int8 weights), as a decode step streams
    the weights. The modules keep the last value set (the chooser then sets its choice)."""
    @torch.inference_mode()
    def timer(group: list[Linear], rows: int) -> dict[str, float]:
        def dtype(m: Linear) -> torch.dtype:
            return torch.float32 if m.qweight is not None else m.weight.dtype
        xs = {(m.in_features, dtype(m)): torch.randn(rows, m.in_features, dtype=dtype(m)) for m in group}

        def one_pass(value: object) -> None:
            for m in group:
                setattr(m, path, value)
                m.gemv(xs[m.in_features, dtype(m)])
        return execution.fastest({name: (lambda v=value: one_pass(v)) for name, value in READINGS[path].items()})
    return timer


def _choose_reading(model: nn.Module, record: execution.ExecutionPlan, path: str, timer: Bf16RowTimer | None) -> str:
    """Set the Linear attribute named `path` (a path of READINGS) on every CPU Linear of model with a grouped, an
    int8 or a dense fp32 or bf16 weight, by _choose_row_loop (the same sums either way). "<path>: <chosen>
    (why)"."""
    group = [m for m in model.modules() if isinstance(m, Linear) and m.weight.device.type == "cpu" and (
        m.grouped is not None or m.qweight is not None
        or (not m.released and m.weight.dtype in (torch.float32, torch.bfloat16)))]
    unavailable = ""
    if group:
        try:
            gemv_cpu.load()
            if any(m.grouped is not None for m in group):
                gemv_grouped_cpu.load()
        except native.BuildError as e:
            unavailable = f"the few-row kernel is not built: {e}"
    chosen, reason = _choose_row_loop(record, path, group, "weight", timer or time_gemv_reading(path),
                                      lambda m: gemv_cpu.MAX_ROWS, unavailable, same_sums=True)
    for m in group:
        setattr(m, path, READINGS[path][chosen])
    return f"{path.replace('_', ' ')}: {chosen} ({reason})"


def choose_gemv_prefetch(model: nn.Module, record: execution.ExecutionPlan, timer: Bf16RowTimer | None = None) -> str:
    """Whether the few-row kernel asks for the weights ahead of the row it reads (Linear.gemv_prefetch; after
    choose_grouped_loop and before choose_gemv_streams and choose_gemv, which time the kernel with it)."""
    return _choose_reading(model, record, "gemv_prefetch", timer)


def choose_gemv_streams(model: nn.Module, record: execution.ExecutionPlan, timer: Bf16RowTimer | None = None) -> str:
    """The order each thread reads its weight rows in (Linear.gemv_streams, gemv_cpu.STREAMS; two are always asked
    for ahead, gemv_cpu.reading): after choose_gemv_prefetch, with its choice, and before choose_gemv."""
    return _choose_reading(model, record, "gemv_streams", timer)


@torch.inference_mode()
def time_grouped_loop(group: list[Linear], rows: int) -> dict[str, float]:
    """Each of gemv_grouped_cpu.WIDEST over every module in group at `rows` rows of its activations' dtype, as a
    decode step streams the weights, by the plan's timer."""
    xs = {(m.in_features, m.weight.dtype): torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in group}

    def one_pass(loop: str) -> None:
        for m in group:
            grouped.grouped_linear(xs[m.in_features, m.weight.dtype], m.grouped, m.bias, "gemv", loop=loop)
    return execution.fastest({loop: (lambda loop=loop: one_pass(loop)) for loop in gemv_grouped_cpu.WIDEST})


def choose_grouped_loop(model: nn.Module, record: execution.ExecutionPlan, timer: Bf16RowTimer | None = None) -> str:
    """Set grouped_loop on every Linear holding a grouped weight (before choose_gemv, which times the kernel in
    it; the `gemv_grouped_loop` path of record), by _choose_row_loop. The chosen loop, or
    why chunks."""
    group = [m for m in model.modules() if isinstance(m, Linear) and m.grouped is not None]
    unavailable = ""
    if group:
        try:
            unavailable = "" if gemv_grouped_cpu.vnni() or gemv_grouped_cpu.runs("avx2") else \
                "neither AVX512-VNNI nor AVX2 on this CPU: both are the same portable loop"
        except native.BuildError as e:
            unavailable = f"the few-row kernel is not built: {e}"
    chosen, reason = _choose_row_loop(record, "gemv_grouped_loop", group, "grouped weight",
                                      timer or time_grouped_loop, lambda m: gemv_grouped_cpu.MAX_ROWS, unavailable)
    for m in group:
        m.grouped_loop = chosen
    return f"gemv grouped loop: {chosen} ({reason})"


def _choose_row_loop(record: execution.ExecutionPlan, path: str, group: list[Linear], what: str,
                     timer: Bf16RowTimer, rows_of: Callable[[Linear], int], unavailable: str,
                     same_sums: bool = False) -> tuple[str, str]:
    """(loop, why) for the few-row kernel's loop of record `path` (execution.PATHS[path]: the default, then the
    challenger). Pinned: that loop. Auto: one pass per loop and row count over the modules in group that run that
    many rows (rows_of: the most rows a module runs the kernel at), up to PASS_ROWS, by the plan's timer (fastest
    of REPS interleaved rounds); the challenger replaces the default only where it beats it (plan.beats) at one row
    and no row count beats it: one loop for every row count, so a row's sums do not depend on the batch. same_sums
    (the two compute the same sums in the same order): the challenger where it beats the default at some row count
    and loses at none. unavailable: why the loops cannot differ here ("" if they can)."""
    default, challenger = execution.PATHS[path]
    pin = record.pinned(path)
    chosen, timings, reason = default if pin == execution.AUTO else pin, [], ""
    if not group:
        reason = f"no {what} runs the few-row kernel"
    elif unavailable:
        reason = unavailable
    elif pin == execution.AUTO:
        wins, losses = [], []     # per row count from 1: the challenger beats the default; the default beats it
        # Rows past PASS_ROWS run the same loop again over each weight row, from L1: 1..PASS_ROWS rows decide.
        for rows in range(1, min(max(map(rows_of, group)), gemv_cpu.PASS_ROWS) + 1):
            best = timer([m for m in group if rows_of(m) >= rows], rows)
            timings += [execution.Timing(loop, best[loop], rows) for loop in (default, challenger)]
            wins.append(execution.beats(best[challenger], best[default]))
            losses.append(execution.beats(best[default], best[challenger]))
        chosen = challenger if not any(losses) and (any(wins) if same_sums else wins[0]) else default
        reason = f"timed over {len(group)} {what}s"
    if pin != execution.AUTO:
        reason = f"pinned by --fast-paths {path}={pin}" + (f"; {reason}" if reason else "")
    record.record(path, chosen, timings, reason)
    return chosen, reason


# (modules of one shape, each path's call on its first module) -> {path: seconds for one call}.
GroupedTimer = Callable[[list[Linear], dict[str, Callable[[], object]]], dict[str, float]]
# Rows of x the many-row paths are timed at, above the few-row kernel: a decode batch and a prefill chunk's
# order of magnitude. The path with the least time per row summed over them runs every count above gemv_rows.
GROUPED_ROWS = (32, 256)
# Output rows timed, as INT8_GEMM_OUT: a 128256-row LM head is timed on its first GROUPED_OUT (rows of a grouped
# weight are contiguous, so the slice is a view).
GROUPED_OUT = 3072


def grouped_paths(gw: grouped.GroupedWeight, dtype: torch.dtype) -> tuple[str, ...]:
    """The many-row paths (plan.PATHS["grouped_matmul"]) that take gw with x of dtype: dequant always, int4pack
    where torch's 4-bit kernel takes the weight, tiles where widen_gemm_cpu runs for dtype, amx where it has the
    tile unit."""
    fits = {"dequant": True, "int4pack": grouped.int4pack_fits(gw), "tiles": widen_gemm_cpu.available(dtype),
            "amx": widen_gemm_cpu.products_for(dtype, "amx") is not None}
    return tuple(p for p in execution.PATHS["grouped_matmul"] if fits[p])


def _grouped_calls(group: list[Linear], paths: tuple[str, ...]) -> dict[int, dict[str, Callable[[], object]]]:
    """Per GROUPED_ROWS count, one call of each path on the shape's first module (its first GROUPED_OUT output
    rows, packed for torch's 4-bit kernel once): at these counts the arithmetic, not the streaming of weights,
    decides, and a pass over all 16 layers of a 1B model took minutes at load."""
    m, n = group[0], min(group[0].out_features, GROUPED_OUT)
    part = m.grouped.rows(0, n)
    bias = None if m.bias is None else m.bias[:n]
    packed = grouped.int4pack(part, m.weight.dtype) if "int4pack" in paths else None

    def calls(x: torch.Tensor) -> dict[str, Callable[[], object]]:
        return {path: (lambda path=path: grouped.grouped_linear(x, part, bias, path, packed)) for path in paths}
    return {rows: calls(torch.randn(rows, m.in_features, dtype=m.weight.dtype)) for rows in GROUPED_ROWS}


@torch.inference_mode()
def time_grouped(group: list[Linear], calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each path's call (_grouped_calls), by the plan's timer: the fastest of INT8_GEMM_REPS rounds."""
    return execution.fastest(calls, reps=INT8_GEMM_REPS)


def choose_grouped_matmul(model: nn.Module, record: execution.ExecutionPlan, timer: GroupedTimer | None = None) -> str:
    """Set grouped_path (and int4pack) on every Linear holding a grouped weight, per shape (the `grouped_matmul`
    path of record): pinned, that path where the shape takes it (grouped_paths; else dequant, with the reason);
    auto, each path the shape takes timed at GROUPED_ROWS rows (dropped after a count at which it was
    DECISIVE times the fastest) and the least time per row summed over them kept if it beats dequant
    (plan.pick). A summary."""
    name = "grouped_matmul"
    default = execution.PATHS[name][0]
    pin = record.pinned(name)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.grouped is not None]
    if not linears:
        record.record(name, default, reason="no grouped weights")
        return "grouped matmul: none (no grouped weights)"
    shapes: dict[tuple, list[Linear]] = {}
    for m in linears:
        gw = m.grouped
        shapes.setdefault((gw.out_features, gw.in_features, gw.describe(), m.weight.dtype, m.bias is not None),
                          []).append(m)
    usable = {key: grouped_paths(group[0].grouped, key[3]) for key, group in shapes.items()}
    if pin not in (execution.AUTO, default) and not any(pin in paths for paths in usable.values()):
        why = {"int4pack": f"no grouped weight fits torch's 4-bit kernel (4-bit, groups of {grouped.INT4PACK_GROUP}, "
                           f"out_features a multiple of {grouped.INT4PACK_N})",
               "tiles": "this CPU or build has no widen_gemm_cpu kernel for the model's dtype (it needs AVX-512 or "
                        "AVX2 with FMA, and for bf16 the bf16 dot product)",
               "amx": widen_gemm_cpu.NO_TILE_UNIT}[pin]
        raise ValueError(f"--fast-paths {name}={pin}: {why}")
    chosen: dict[str, list[str]] = {}
    for key, group in shapes.items():
        out, inp, kind, dtype, bias = key
        paths, timings, reason = usable[key], [], ""
        if pin != execution.AUTO:
            path = pin if pin in paths else default
            reason = (f"pinned by --fast-paths {name}={pin}" if path == pin
                      else f"pinned {pin}, which does not take this weight")
        elif len(paths) == 1:
            path, reason = default, "no other path takes this weight"
        else:
            per_row, timed, calls = dict.fromkeys(paths, 0.0), paths, _grouped_calls(group, paths)
            for rows in GROUPED_ROWS:
                best = (timer or time_grouped)(group, {p: calls[rows][p] for p in timed})
                timings += [execution.Timing(p, best[p], rows) for p in timed]
                for p in paths:
                    # A path DECISIVE times slower than the fastest is not timed at more rows (torch's 4-bit kernel
                    # over fp32 x ran at 2 GFLOP/s on a Zen 4: seconds a call at 256 rows), nor kept.
                    per_row[p] += best[p] / rows if p in timed else math.inf
                timed = tuple(p for p in timed if best[p] <= DECISIVE * min(best.values()))
            path = execution.pick(per_row, default)
        for m in group:
            m.grouped_path = path
            m.int4pack = grouped.int4pack(m.grouped, dtype) if path == "int4pack" else None
        if path in widen_gemm_cpu.PATH_KERNELS:
            products = widen_gemm_cpu.products_for(dtype, widen_gemm_cpu.PATH_KERNELS[path])
            reason = "; ".join(filter(None, (reason, f"products in {products}")))
        record.record(f"{name} {out}x{inp}{'+b' if bias else ''} {kind}", path, timings, reason)
        chosen.setdefault(path, []).append(f"{out}x{inp}")
    return "grouped matmul " + "; ".join(f"{p} on {','.join(s)}" for p, s in chosen.items())
