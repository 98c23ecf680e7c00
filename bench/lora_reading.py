"""The CPU multi-LoRA operator's ways of asking for adapter rows (lora_cpu.PREFETCH), side by side in one process.

Every row on its own adapter (ranks 8 and 16 in turn, as bench/lora.py's distinct part), rows read from an arena
far larger than the caches, so that they come from memory as a decode step's do. Per call one projection of
SmolLM2-135M's decode stack: all its LoRA targets' widths in one output (q, k, v: 576 -> 960; o: 576 -> 576;
gate, up: 576 -> 3072; down: 1536 -> 576). The candidates take turns call by call on fresh rows, so a neighbour
on the memory bus slows none more than another; each cell is the median of --calls calls. Prints each cell's
time and the rate its adapter rows were read at, the machine's read probe, and last the ratios (paced over
burst, paced over off: time of the other over paced's; above 1, paced is faster).

    .venv/bin/python bench/lora_reading.py [--rows 4,64] [--calls 150] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decoder import read_bandwidth  # noqa: E402
from bench.workload import cpu_line  # noqa: E402
from services.decoder.kernels import lora_cpu  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # name: (K, N)
ARENA = 512 << 20  # bytes of A and Bt per cell: sixteen times a 32 MiB L3


def cell(dtype: torch.dtype, rows: int, K: int, N: int, calls: int) -> dict[str, float]:
    """{candidate: median seconds of one lora_rows call} for `rows` rows on distinct adapters."""
    ranks = torch.tensor([16 if i % 2 else 8 for i in range(rows)], dtype=torch.int32)
    span = int(ranks.sum())
    sets = ARENA // ((K + N) * span * dtype.itemsize)
    A = torch.full((sets * span, K), 0.01, dtype=dtype)
    Bt = torch.full((sets * span, N), 0.01, dtype=dtype)
    x, y = torch.randn(rows, K).to(dtype), torch.zeros(rows, N, dtype=dtype)
    first = torch.cumsum(ranks, 0, dtype=torch.int32) - ranks
    grain = lora_cpu.GRAINS["fine" if rows < 64 else "coarse"]
    seconds = {name: [] for name in lora_cpu.PREFETCH}
    turn = 0
    for _ in range(calls):
        for name, how in lora_cpu.PREFETCH.items():
            offsets = first + (turn * 7 % sets) * span   # 7 sets on: one call's rows do not follow the last's
            turn += 1
            start = time.perf_counter()
            lora_cpu.lora_rows(y, x, A, Bt, offsets, ranks, grain, how)
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="4,64", help="comma-separated row counts (each row its own adapter)")
    ap.add_argument("--calls", type=int, default=150, help="calls per candidate and cell (the median counts)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_line()}; {args.threads} threads; read probe {read_bandwidth() / 1e9:.1f} GB/s")
    ratios = {"burst": [], "off": []}
    for dtype in (torch.float32, torch.bfloat16):
        for rows in map(int, args.rows.split(",")):
            for name, (K, N) in SHAPES.items():
                got = cell(dtype, rows, K, N, args.calls)
                mb = sum(16 if i % 2 else 8 for i in range(rows)) * (K + N) * dtype.itemsize / 1e6
                print(f"{str(dtype)[6:]} {rows} rows {name} ({K} -> {N}, {mb:.2f} MB of rows): " +
                      ", ".join(f"{c} {s * 1e6:.1f} us ({mb / s / 1e3:.1f} GB/s)" for c, s in got.items()))
                for other in ratios:
                    ratios[other].append(got[other] / got["paced"])
    print("lora_reading ratios (geometric mean over the cells; above 1: paced faster): " + ", ".join(
        f"paced vs {other} {statistics.geometric_mean(r):.3f}x (min {min(r):.3f}, max {max(r):.3f})"
        for other, r in ratios.items()))


if __name__ == "__main__":
    main()
