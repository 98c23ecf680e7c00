"""BGMV / SGMV Triton LoRA kernels vs the torch grouped reference, on one CUDA GPU.

    .venv/bin/python bench/lora_kernels.py            # on a CUDA machine (~1-2 min on an H200)
    .venv/bin/python bench/lora_kernels.py --dry-run  # CPU, Triton interpreter, tiny shapes

1. Correctness: BGMV and SGMV (and lora_apply's dispatch) against the fp32 torch
   refs in fp16 and bf16: mixed ranks zero-padded, slot -1 rows, segments of
   length 0/1/many, widths that are not block multiples. Prints the max abs
   error; any mismatch exits 1 before timing.
2. Timing (fp16): decode rows through BGMV and a 2048-row prefill through SGMV,
   against the spec's grouped torch ref (torch.where per slot, shrink, expand,
   scatter), over ranks 8/16/64, 1-32 adapters and widths K->D of 576->576,
   576->1536 (SmolLM2) and 4096->4096. The per-step grouping (build_lora_meta)
   is built once per step and reused by every projection, so it is not inside
   the kernel time; its cost is printed once. Both sides add into y in place.
The last line is the geometric-mean speedup (ref time / kernel time) over all rows.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU only: run the correctness checks and a tiny timing table under TRITON_INTERPRET=1")
    p.add_argument("--rep-ms", type=float, default=25.0, help="timing budget per measurement (GPU)")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="stop starting new timing cases after this many seconds (the table stays valid)")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.dry_run:
    # Must precede the kernel imports: @triton.jit reads it at decoration time.
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.decoder.kernels.bgmv import bgmv, bgmv_ref  # noqa: E402
from services.decoder.kernels.lora import backend_name, grouped_lora_ref, lora_apply  # noqa: E402
from services.decoder.kernels.lora_meta import build_lora_meta  # noqa: E402
from services.decoder.kernels.sgmv import sgmv, sgmv_ref  # noqa: E402

# |out - ref| <= ATOL + RTOL * |ref|, with y and the correction O(1). The refs do
# fp32 math; the kernels' half-precision dot operands round the rank-R
# intermediate once, and the final store rounds once.
TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 2e-2)}


def make_case(n, k, d, ranks, dtype, device, seed=0):
    """x [n,k], y [n,d], A [S,Rmax,k], B [S,d,Rmax] with adapter s of true rank ranks[s], zero-padded."""
    # Generated on the device: CPU randn of 4096-wide adapters would dominate the run.
    g = torch.Generator(device=device).manual_seed(seed)
    rmax = max(ranks)
    A = torch.zeros(len(ranks), rmax, k, device=device)
    B = torch.zeros(len(ranks), d, rmax, device=device)
    for s, r in enumerate(ranks):
        A[s, :r] = torch.randn(r, k, generator=g, device=device) / k ** 0.5
        B[s, :, :r] = torch.randn(d, r, generator=g, device=device) / r ** 0.5
    x = torch.randn(n, k, generator=g, device=device)
    y = torch.randn(n, d, generator=g, device=device)
    return tuple(t.to(dtype=dtype) for t in (x, y, A, B))


def max_err(out, ref, dtype):
    """(max abs error, ok) under TOL[dtype]."""
    atol, rtol = TOL[dtype]
    diff = (out.float() - ref.float()).abs()
    return float(diff.max()) if diff.numel() else 0.0, bool((diff <= atol + rtol * ref.float().abs()).all())


def check_correctness(device, small: bool) -> None:
    """Kernels vs refs in fp16/bf16; exits 1 on any mismatch."""
    if small:
        shapes = [(37, 29)]
        plan = [0] * 20 + [2] + [3] * 5 + [-1] * 3          # slot 1: empty segment
        ranks = [16, 1, 8, 5]
    else:
        shapes = [(576, 1536), (100, 300), (4096, 4096)]
        plan = [0] * 300 + [2] + [3] * 40 + [5] * 7 + [-1] * 30   # slots 1, 4: empty
        ranks = [64, 1, 8, 16, 3, 33]
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor(plan)[torch.randperm(len(plan), generator=g)]
    decode_slots = slots[:24]
    failures = []
    print(f"correctness on {device} (backend_name={backend_name(device)}): ranks {ranks}, "
          f"{len(plan)} prefill rows, {len(decode_slots)} decode rows", flush=True)
    for dtype in (torch.float16, torch.bfloat16):
        for k, d in shapes:
            x, y, A, B = make_case(len(plan), k, d, ranks, dtype, device)
            meta = build_lora_meta(slots, device=device, num_slots=len(ranks), decode_only=False)
            dmeta = build_lora_meta(decode_slots, device=device, decode_only=True)
            xd, yd = x[:24].contiguous(), y[:24].contiguous()
            results = {
                "bgmv": (bgmv(yd.clone(), xd, A, B, dmeta.slots), bgmv_ref(yd, xd, A, B, decode_slots), yd,
                         decode_slots),
                "sgmv": (sgmv(y.clone(), x, A, B, meta), sgmv_ref(y, x, A, B, meta), y, slots),
                "lora_apply/decode": (lora_apply(yd.clone(), xd, A, B, dmeta, backend="triton"),
                                      bgmv_ref(yd, xd, A, B, decode_slots), yd, decode_slots),
                "lora_apply/prefill": (lora_apply(y.clone(), x, A, B, meta, backend="triton"),
                                       sgmv_ref(y, x, A, B, meta), y, slots),
            }
            for name, (out, ref, y0, sl) in results.items():
                err, ok = max_err(out, ref, dtype)
                base = (sl < 0).to(out.device)
                exact = torch.equal(out[base], y0[base])
                status = "ok" if ok and exact else "MISMATCH"
                print(f"  {name:18s} {str(dtype):15s} K={k:<5d} D={d:<5d} max|err|={err:.3e}"
                      f"  slot-1 rows exact={exact}  {status}", flush=True)
                if status != "ok":
                    failures.append((name, dtype, k, d))
    if failures:
        print(f"FAILED: kernel/ref mismatch in {failures}", flush=True)
        sys.exit(1)


def make_timer(device, rep_ms):
    """Median time of fn() in microseconds."""
    if device.type == "cuda":
        import triton.testing

        def timer(fn):
            return 1e3 * triton.testing.do_bench(fn, warmup=max(2.0, rep_ms / 4), rep=rep_ms, return_mode="median")
    else:
        def timer(fn, reps=3):
            fn()
            samples = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            return 1e6 * statistics.median(samples)
    return timer


def timing_cases(small: bool):
    """(kind, K, D, rank, adapters, rows) tuples."""
    if small:
        return [("decode", 37, 29, 8, 2, 4), ("prefill", 37, 29, 16, 2, 40)]
    widths = [(576, 576), (576, 1536), (4096, 4096)]
    cases = []
    for k, d in widths:
        for rank in (8, 16, 64):
            for n in (1, 4, 8, 16, 32):
                cases.append(("decode", k, d, rank, n, 256))
        for rows in (1, 8, 32, 128):                     # decode batch-size sweep
            cases.append(("decode", k, d, 16, min(8, rows), rows))
        for rank in (8, 16, 64):
            for n in (1, 4, 8, 16, 32):
                cases.append(("prefill", k, d, rank, n, 2048))
    return cases


def bench_fns(kind, y, x, A, B, meta, slots):
    """(kernel, ref) closures; both add the correction into y in place."""
    if kind == "decode":
        def kernel():
            return bgmv(y, x, A, B, meta.slots)
    else:
        def kernel():
            return sgmv(y, x, A, B, meta)

    def ref():
        # The spec's grouped path regroups with torch.where on every call, as it
        # would in every projection of every layer.
        return y.add_(grouped_lora_ref(x, A, B, slots))
    return kernel, ref


def run_timing(device, small: bool, rep_ms: float, deadline: float) -> list[float]:
    timer = make_timer(device, rep_ms)
    dtype = torch.float16
    g = torch.Generator().manual_seed(2)
    t0 = time.perf_counter()
    build_lora_meta(torch.randint(0, 32, (2048,), generator=g), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"\nbuild_lora_meta (once per step, shared by all layers/projections), 2048 rows / 32 adapters: "
          f"{1e6 * (time.perf_counter() - t0):.0f} us", flush=True)
    print(f"\n{'kind':8s} {'K':>5s} {'D':>5s} {'rank':>4s} {'adapters':>8s} {'rows':>5s} "
          f"{'kernel us':>10s} {'ref us':>10s} {'speedup':>8s}", flush=True)
    speedups = []
    cases = timing_cases(small)
    for i, (kind, k, d, rank, n, rows) in enumerate(cases):
        if time.perf_counter() > deadline:
            print(f"time budget reached: skipped the last {len(cases) - i} of {len(cases)} cases", flush=True)
            break
        x, y, A, B = make_case(rows, k, d, [rank] * n, dtype, device, seed=rank + n)
        slots = torch.randint(0, n, (rows,), generator=g)
        meta = build_lora_meta(slots, device=device, decode_only=(kind == "decode"))
        kernel, ref = bench_fns(kind, y, x, A, B, meta, slots.to(device))
        k_us, r_us = timer(kernel), timer(ref)
        speedups.append(r_us / k_us)
        print(f"{kind:8s} {k:5d} {d:5d} {rank:4d} {n:8d} {rows:5d} {k_us:10.1f} {r_us:10.1f} "
              f"{r_us / k_us:7.2f}x", flush=True)
    return speedups


def main() -> None:
    started = time.perf_counter()
    if ARGS.dry_run:
        device = torch.device("cpu")
        print("dry run: CPU, TRITON_INTERPRET=1, tiny shapes; timings are meaningless", flush=True)
    else:
        if not torch.cuda.is_available():
            print("bench/lora_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False). "
                  "Use --dry-run to exercise it on CPU under the Triton interpreter.", flush=True)
            sys.exit(2)
        device = torch.device("cuda")
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    check_correctness(device, small=ARGS.dry_run)
    speedups = run_timing(device, small=ARGS.dry_run, rep_ms=ARGS.rep_ms, deadline=started + ARGS.budget_s)
    print(f"\ncases: {len(speedups)}, wall {time.perf_counter() - started:.1f} s", flush=True)
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    print(f"geometric-mean speedup (torch grouped ref / triton kernel): {geo:.3g}x", flush=True)


if __name__ == "__main__":
    main()
