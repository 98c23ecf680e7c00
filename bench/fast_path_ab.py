"""One decoder fast path pinned each way, side by side in one process: batch-1 decode and a few concurrent chats.

Two engines over the same checkpoint, one with `--path` pinned to each of two candidates (every other path timed
at load as usual), run in alternating rounds so that load from other processes, or a neighbour on the host's
memory bus, penalises neither side more: per round, batch-1 decode tok/s (bench/decoder.py's batch1_rate, 64
tokens over a cached prompt) and --chats concurrent GSM8K chats' tok/s end to end (cold cache, 64 tokens each).
Prints every round, the medians, and last the ratios of the medians (second candidate over first).

    python bench/fast_path_ab.py --path gemv_prefetch [--variant int8] [--rounds 5] [--model DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decoder import VARIANTS, Tessera, batch1_rate, prompts  # noqa: E402
from bench.workload import SMOLLM2, cpu_line  # noqa: E402
from services.common.plan import PATHS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True, choices=sorted(PATHS), help="the fast path pinned each way")
    ap.add_argument("--candidates", default="", help="two of the path's candidates, comma-separated "
                                                     "(default: its first two)")
    ap.add_argument("--variant", default="fp32", choices=sorted(VARIANTS), help="weights: dtype or quantization")
    ap.add_argument("--model", type=Path, default=SMOLLM2, help="a checkpoint folder (default SmolLM2-135M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.candidates.split(",") if args.candidates else list(PATHS[args.path][:2])
    if len(names) != 2 or not set(names) <= set(PATHS[args.path]):
        sys.exit(f"--candidates: two of {', '.join(PATHS[args.path])}")
    chats = prompts(args.chats)
    engines = {n: Tessera(args.variant, num_blocks=1024, budget=2048, max_seqs=args.chats,
                          fast_paths=f"{args.path}={n}", folder=args.model) for n in names}
    runs = {n: ([], []) for n in names}
    print(f"CPU: {cpu_line()}, {args.threads} threads; {args.model.name} {args.variant}; {args.path} "
          f"{' vs '.join(names)}", flush=True)
    for r in range(args.rounds):
        for n, engine in engines.items():
            one = batch1_rate(engine, chats[0], 64, f"{r}{n}")
            engine.cold()
            engine.generate(chats[:2], 4, tag=f"w{r}{n}")
            _, seconds = engine.generate(chats, 64, tag=f"c{r}{n}")
            runs[n][0].append(one)
            runs[n][1].append(len(chats) * 64 / seconds)
            print(f"round {r + 1} {args.path}={n}: batch-1 {one:.1f} tok/s, {args.chats} chats "
                  f"{runs[n][1][-1]:.1f} tok/s", flush=True)
    med = {n: (statistics.median(b1), statistics.median(c)) for n, (b1, c) in runs.items()}
    for n, (b1, c) in med.items():
        print(f"median {args.path}={n}: batch-1 {b1:.1f} tok/s, {args.chats} chats {c:.1f} tok/s")
    a, b = names
    print(f"ratios {b}/{a}: batch1={med[b][0] / med[a][0]:.2f}x chats{args.chats}={med[b][1] / med[a][1]:.2f}x")


if __name__ == "__main__":
    main()
