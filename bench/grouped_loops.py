"""The few-row kernel's loops over grouped weights (kernels/gemv_grouped.h), side by side on one decode step's bytes.

    .venv/bin/python bench/grouped_loops.py                  # int4, groups of 32, 1 row, 1 and 2 threads
    .venv/bin/python bench/grouped_loops.py --bits 8 --group 16 --rows 4
    .venv/bin/python bench/grouped_loops.py --shape smollm2 --ahead 8192   # K = 576: short rows

The weights of a Llama-3.2-1B-shaped decoder (16 layers of qkv 3072x2048, o 2048x2048, gate_up 16384x2048 and down
2048x8192, and the tied 128256x2048 head; random codes) are laid out in one huge-page arena, as the decoder holds
them (services/common/arena.py), and one pass over all of them at batch 1 is timed for each of
gemv_grouped_cpu.WIDEST (the plan's `gemv_grouped_loop`): the fastest of --rounds alternating passes each, so both
loops see the same machine state. Far larger than any cache, a pass streams from memory as a decode step does
(--shape smollm2: SmolLM2-135M's 30 layers of 960x576, 576x576, 3072x576 and 576x1536 and its 49152x576 head,
repeated until the pass is as large); torch.sum over 1 GiB gives the machine's read bandwidth beside it. The last
line holds the ratio of each loop's passes per second to the first's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workload import cpu_line  # noqa: E402
from services.common import arena  # noqa: E402
from services.decoder.kernels import gemv_cpu, gemv_grouped_cpu  # noqa: E402

# (layer's weights, head) by --shape
SHAPES = {"1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], (128256, 2048)),
          "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576))}


def read_bandwidth() -> float:
    """Bytes/s of torch.sum over 1 GiB, the best of 3."""
    a = torch.ones(2 ** 28)
    a.sum()
    best = min(timed(a.sum) for _ in range(3))
    return a.numel() * a.element_size() / best


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group", type=int, default=32, choices=(16, 32))
    ap.add_argument("--rows", type=int, default=1, help=f"rows of x (1..{gemv_grouped_cpu.MAX_ROWS})")
    ap.add_argument("--shape", choices=SHAPES, default="1b", help="whose weights: Llama-3.2-1B's or SmolLM2-135M's")
    ap.add_argument("--layers", type=int, default=16, help="layers of the 1b shape (smollm2: 30 per model, "
                    "repeated to the 1b shape's bytes)")
    ap.add_argument("--ahead", type=int, default=0, help="prefetch distance in bytes of codes (0: none; the "
                    f"decoder's gemv_prefetch path asks {gemv_cpu.PREFETCH_BYTES} ahead)")
    ap.add_argument("--rounds", type=int, default=6, help="alternating passes per loop; the fastest counts")
    ap.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    args = ap.parse_args(argv)
    loops = gemv_grouped_cpu.WIDEST
    print(f"CPU: {cpu_line()}; {args.shape} shapes, int{args.bits}/g{args.group}, {args.rows} row(s), "
          f"{args.ahead} bytes ahead; loops {', '.join(loops)}"
          + ("" if gemv_grouped_cpu.vnni() else " (no AVX512-VNNI: the AVX2 loop's two orders)"
             if gemv_grouped_cpu.runs("avx2") else " (neither AVX512-VNNI nor AVX2: both are the portable loop)"))
    g = torch.Generator().manual_seed(0)
    big = SHAPES["1b"][0] * args.layers + [SHAPES["1b"][1]]
    shapes = big
    if args.shape == "smollm2":  # copies of the model, as many bytes as the 1b shape: a pass streams from memory
        layer, head = SHAPES["smollm2"]
        model = layer * 30 + [head]
        shapes = model * max(1, round(sum(n * k for n, k in big) / sum(n * k for n, k in model)))
    tensors = []
    for n, k in shapes:
        tensors += [torch.randint(0, 256, (n, k * args.bits // 8), dtype=torch.uint8, generator=g),
                    (torch.rand(n, k // args.group, generator=g) * 0.01).half(),
                    (torch.rand(n, k // args.group, generator=g) * -0.01).half()]
    _, tensors, summary = arena.place(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"weights: {nbytes / 1e6:.0f} MB, {summary}")
    weights = [tensors[i:i + 3] for i in range(0, len(tensors), 3)]
    xs = {k: torch.randn(args.rows, k, generator=g) for k in {k for _, k in shapes}}

    def one_pass(loop: str) -> None:
        for (_, k), (codes, scale, offset) in zip(shapes, weights, strict=True):
            gemv_grouped_cpu.gemv_grouped(xs[k], codes, scale, offset, args.bits, args.group, None, loop,
                                          args.ahead)

    ratios = []
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        best = {loop: float("inf") for loop in loops}
        for r in range(args.rounds):
            for loop in loops if r % 2 == 0 else loops[::-1]:
                one_pass(loop)
                best[loop] = min(best[loop], timed(lambda loop=loop: one_pass(loop)))
        bw = read_bandwidth()
        print(f"threads {threads}: " + ", ".join(
            f"{loop} {best[loop] * 1e3:.1f} ms ({nbytes / best[loop] / 1e9:.1f} GB/s, "
            f"{nbytes / best[loop] / bw:.2f} of torch.sum's {bw / 1e9:.1f})" for loop in loops), flush=True)
        ratios += [f"{loop}_vs_{loops[0]}_t{threads}={best[loops[0]] / best[loop]:.3f}x" for loop in loops[1:]]
    print("ratios: " + " ".join(ratios))


if __name__ == "__main__":
    main()
