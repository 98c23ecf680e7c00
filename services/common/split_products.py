"""Which fp32 matmuls split their products in bf16 halves on the tile unit (--matmul-precision high).

`--matmul-precision high` lets a float32 model's many-row matmuls (prefill chunks, large batches, an encoder's
forward) carry x and w as the sum of two bf16 numbers and form each product from them on the CPU's tile unit
(services/common/tile_unit.py, gemm_panels_split): a result is then off by about 2^-17 of sum |x w| beyond fp32's
own rounding, what torch's float32 matmul precision "high" allows. On an Intel Xeon with AMX (family 6 model 207,
1-2 threads) it ran 2.0-2.7x oneDNN's fp32 matmul at SmolLM2's and MiniLM's shapes over 97-512 rows, with 3-4e-6
of max |y| off the float64 product (fp32's own: 3-8e-7). `highest`, the default, keeps every product in fp32.

Under `high`, the `split_products` path (services/common/plan.py) is, per fp32 weight shape, the row count from
which the split matmul runs: timed at load at ROWS against the path the shape runs otherwise, from the smallest
count where it won at that count and every larger one, by the plan's tie rule; nowhere where it never did. Pinned
`on`, it runs at every row count the caller hands it; `off`, nowhere. A weight that takes it keeps its split
panels (its own bytes again) beside its dense copy, which every other path still reads.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.common import linear_path, tile_unit
from services.common import plan as execution
from services.common.dtypes import MATMUL_PRECISIONS as PRECISIONS

NAME = "split_products"
# Rows timed: a small prefill chunk or decode batch, a larger one, a prefill chunk.
ROWS = (16, 64, 256)


@dataclass(frozen=True)
class Target:
    """An fp32 weight [out, in] (+ bias [out]) the split may take, and the path it runs otherwise (x -> y)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    own: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Split:
    """What a target runs: the split matmul over its panels from `start` rows on (panels None: never)."""

    start: int = 0
    panels: torch.Tensor | None = None
    out_features: int = 0

    def takes(self, rows: int) -> bool:
        return self.panels is not None and rows >= self.start

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] fp32 -> [rows, out_features] fp32 (+ bias)."""
        return tile_unit.gemm_panels_split(x, self.panels, self.out_features, bias)


# (target, its split panels, rows) -> {"library": s, "split": s}
Timer = Callable[[Target, torch.Tensor, int], dict[str, float]]


@torch.inference_mode()
def time_split(target: Target, panels: torch.Tensor, rows: int) -> dict[str, float]:
    """Seconds per call of the target's own path and of the split matmul, x [rows, in] fp32."""
    x = torch.randn(rows, target.weight.shape[1])
    n = target.weight.shape[0]
    return execution.fastest({"library": lambda: target.own(x),
                              "split": lambda: tile_unit.gemm_panels_split(x, panels, n, target.bias)})


def choose(targets: Sequence[Target], record: execution.ExecutionPlan, precision: str,
           timer: Timer | None = None) -> list[Split]:
    """Each target's Split, as precision and the `split_products` pin allow, timed per shape on its first target;
    each choice recorded in `record` ("split_products 576x576", or one "split_products" where none can run)."""
    if precision not in PRECISIONS:
        raise ValueError(f"--matmul-precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    pin = record.pinned(NAME)
    fp32 = [t.weight.dtype == torch.float32 and t.weight.device.type == "cpu" for t in targets]
    why = ("--matmul-precision highest: every product in fp32" if precision == "highest"
           else "no fp32 CPU weights" if not any(fp32)
           else "" if tile_unit.amx() else "this CPU or build has no tile unit (AMX bf16)")
    if why or pin == "off":
        if pin == "on" and why:
            raise ValueError(f"--fast-paths {NAME}=on: {why}")
        record.record(NAME, "off", reason=why)
        return [Split() for _ in targets]
    starts: dict[linear_path.Shape, int] = {}
    timed: dict[int, torch.Tensor] = {}     # the panels timed, by target: kept where it takes them
    for i, (target, ok) in enumerate(zip(targets, fp32, strict=True)):
        shape = linear_path.Shape.of(target.weight, target.bias)
        if not ok or shape in starts:
            continue
        timings, start = [], 1 if pin == "on" else 0
        if pin != "on":
            panels = timed[i] = tile_unit.pack_split_panels(target.weight)
            wins = []
            for rows in ROWS:
                took = (timer or time_split)(target, panels, rows)
                timings += [execution.Timing(path, s, rows) for path, s in took.items()]
                wins.append(execution.beats(took["split"], took["library"]))
            for rows, won in zip(reversed(ROWS), reversed(wins), strict=True):
                if not won:
                    break
                start = rows
        starts[shape] = start
        record.record(f"{NAME} {shape}", f"on rows>={start}" if start else "off", timings)
    splits = []
    for i, (target, ok) in enumerate(zip(targets, fp32, strict=True)):
        start = starts.get(linear_path.Shape.of(target.weight, target.bias), 0) if ok else 0
        panels = (timed[i] if i in timed else tile_unit.pack_split_panels(target.weight)) if start else None
        splits.append(Split(start, panels, target.weight.shape[0]))
    return splits
