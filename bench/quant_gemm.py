"""Many-row matmuls over quantized weights on CPU: every path the load-time choice weighs, side by side.

    .venv/bin/python bench/quant_gemm.py                       # SmolLM2-135M's and Llama-3.2-1B's shapes
    .venv/bin/python bench/quant_gemm.py --shapes 960x576 --rows 64

For each weight shape (out x in, random weights) and row count, GFLOP/s of:
  int4 (groups of 32, --quantization int4):  dequant, int4pack, tiles (kernels/widen_gemm.h), amx (amx_gemm.h)
  int8 (a scale per row, --quantization int8): int8pack, dequant, dynamic, tiles, amx
  the dense weight through the library matmul, fp32 and bf16 (what the quantized paths stand in for)
with fp32 activations (as `bench/decoder.py` and `bench/real_size.py` run int8 and int4), each the fastest of
--reps interleaved rounds. Paths this CPU does not run are left out (one line says why). The last line holds
the ratio of `tiles` and of `amx` to the best other path of their format, geometric mean over the cases.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workload import cpu_line  # noqa: E402
from services.common import plan as execution  # noqa: E402
from services.decoder.model import grouped, quantization  # noqa: E402
from services.decoder.model.matmul_choice import grouped_paths  # noqa: E402

SHAPES = "960x576,576x576,3072x576,576x1536,3072x2048,16384x2048,2048x8192"
WIDEN = ("tiles", "amx")     # the paths widen_gemm_cpu runs (the weight widened block by block in cache)


def calls(n: int, k: int, rows: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(n * k + rows)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    gw = grouped.quantize(w, 4, 32)
    q, scale = quantization.quantize(w)
    wb, xb = w.bfloat16(), x.bfloat16()
    out = {"dense fp32": lambda: F.linear(x, w), "dense bf16": lambda: F.linear(xb, wb)}
    packed = grouped.int4pack(gw, x.dtype) if grouped.int4pack_fits(gw) else None
    for path in grouped_paths(gw, x.dtype):
        out[f"int4 {path}"] = lambda path=path: grouped.grouped_linear(x, gw, None, path, packed)
    for name, f in quantization.usable_gemms(x.dtype).items():
        out[f"int8 {name}"] = lambda f=f: f(x, q, scale, None)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma list of OUTxIN weight shapes")
    ap.add_argument("--rows", default="16,64,256,512", help="comma list of row counts")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds per case; the fastest counts")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_line()}; torch threads {args.threads}; fp32 activations")
    for name in quantization.GEMMS:
        if why := quantization.unusable(name, torch.float32):
            print(f"int8 {name} and int4's like it: not run here ({why})")
    ratios: dict[str, list[float]] = {f"{fmt} {kernel}": [] for kernel in WIDEN for fmt in ("int4", "int8")}
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            for rows in map(int, args.rows.split(",")):
                paths = calls(n, k, rows)
                best = execution.fastest(paths, reps=args.reps)
                flops = 2 * rows * n * k
                print(f"{shape} rows {rows}: " + "  ".join(f"{p} {flops / s / 1e9:.0f}" for p, s in best.items()),
                      flush=True)
                for path in ratios:
                    fmt = path.split()[0]
                    others = [s for p, s in best.items() if p.startswith(fmt) and p.split()[1] not in WIDEN]
                    if path in best and others:
                        ratios[path].append(min(others) / best[path])
    print("widened in cache (tiles: vector FMAs or bf16 dot products; amx: the tile unit) vs the best other path of "
          "the format (geometric mean): " + "; ".join(f"{path} {math.exp(sum(map(math.log, r)) / len(r)):.2f}x"
                                           for path, r in ratios.items() if r))


if __name__ == "__main__":
    main()
