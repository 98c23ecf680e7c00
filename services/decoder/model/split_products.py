"""fp32 matmuls on the tile unit with each product split in bf16 halves, where the operator allows it.

`--matmul-precision high` lets a float32 model's many-row matmuls (prefill chunks, large batches) carry x
and w as the sum of two bf16 numbers, hi = bf16(v) and lo = bf16(v - hi), and form each product as
hi hi + lo hi + hi lo on the CPU's tile unit (AMX bf16; kernels/amx_gemm.h, gemm_split): every product of
bf16 is exact in fp32 and the sums are fp32, so a result is off by about 2^-17 of sum |x w| beyond fp32's
own rounding, what torch's float32 matmul precision "high" allows ("each float32 number as the sum of two
bfloat16 numbers"). On an Intel Xeon with AMX (family 6 model 207, 1-2 threads) it ran 2.0-2.7x oneDNN's
fp32 matmul at SmolLM2's and MiniLM's shapes, 97-512 rows, with 3-4e-6 of max |y| off the float64 product
(fp32's own: 3-8e-7). `highest` (the default) keeps every product in fp32.

Under `high`, the `split_products` path (services/common/plan.py) is, per fp32 weight shape, the row count
from which the split matmul runs: timed at load at ROWS against the shape's own path (packed or plain, its
`linear` rule), from the smallest count where it won at that and every larger one; never where it did not
win. Pinned `on`, it runs at every row count the few-row kernel leaves; `off`, nowhere. A Linear that
takes it holds its weight's split panels (the weight's own bytes again) beside its dense weight, which
the decode stack and the few-row kernel keep reading: those stay fp32 throughout.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from services.common import linear_path
from services.common import plan as execution
from services.decoder.kernels import widen_gemm_cpu
from services.decoder.model.linear import Linear

PRECISIONS = ("highest", "high")
NAME = "split_products"
# Rows timed: a small prefill chunk or decode batch, a larger one, a prefill chunk.
ROWS = (16, 64, 256)

# (linear, its split panels, rows) -> {"library": s, "split": s}
SplitTimer = Callable[[Linear, torch.Tensor, int], dict[str, float]]


@torch.inference_mode()
def time_split(m: Linear, panels: torch.Tensor, rows: int) -> dict[str, float]:
    """Seconds per call of the linear's own many-row path and of the split matmul, x [rows, in] fp32."""
    x = torch.randn(rows, m.in_features)
    own = (lambda: linear_path.packed_linear(x, m.packed, m.bias)) if m.packed is not None and \
        m.rule.use_packed(rows) else (lambda: torch.nn.functional.linear(x, m.weight, m.bias))
    return execution.fastest({"library": own,
                              "split": lambda: widen_gemm_cpu.gemm_panels_split(x, panels, m.out_features, m.bias)})


def choose_split(model: nn.Module, record: execution.ExecutionPlan, precision: str,
                 timer: SplitTimer | None = None) -> str:
    """Give each dense fp32 Linear of model its split panels and the rows from which they run (Linear.split,
    Linear.split_from), as precision and the `split_products` pin allow; record each choice. Returns a summary."""
    if precision not in PRECISIONS:
        raise ValueError(f"--matmul-precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    pin = record.pinned(NAME)
    linears = [m for m in model.modules() if isinstance(m, Linear) and not m.released and m.qweight is None
               and m.grouped is None and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    why = ("--matmul-precision highest: every product in fp32" if precision == "highest"
           else "no dense fp32 CPU weights" if not linears
           else "" if widen_gemm_cpu.amx() else "this CPU or build has no tile unit (AMX bf16)")
    if why or pin == "off":
        if pin == "on" and why:
            raise ValueError(f"--fast-paths {NAME}=on: {why}")
        record.record(NAME, "off", reason=why)
        return "off"
    shapes: dict[linear_path.Shape, list[Linear]] = {}
    for m in linears:
        shapes.setdefault(linear_path.Shape.of(m.weight, m.bias), []).append(m)
    chosen = []
    for shape, group in shapes.items():
        first = group[0]
        panels = widen_gemm_cpu.pack_split_panels(first.weight)
        timings, start = [], (1 if pin == "on" else 0)
        if pin != "on":
            wins = []
            for rows in ROWS:
                took = (timer or time_split)(first, panels, rows)
                timings += [execution.Timing(path, s, rows) for path, s in took.items()]
                wins.append(execution.beats(took["split"], took["library"]))
            # From the smallest count where it won at that and every larger one.
            for rows, won in zip(reversed(ROWS), reversed(wins), strict=True):
                if not won:
                    break
                start = rows
        for i, m in enumerate(group):
            m.split_from = start
            m.split = (panels if i == 0 else widen_gemm_cpu.pack_split_panels(m.weight)) if start else None
        verdict = f"on rows>={start}" if start else "off"
        record.record(f"{NAME} {shape}", verdict, timings)
        chosen.append(f"{verdict} on {shape}")
    return "; ".join(chosen)
