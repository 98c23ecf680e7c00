"""Compile every LoRA kernel variant for sm_90 (H100/H200) on a machine without a GPU.

The interpreter never runs Triton's GPU compiler, so a kernel can pass every
interpreter test and still fail to compile (tl.dot shape/dtype rules, layouts).
Run as a script with TRITON_INTERPRET unset; prints one line per variant.
"""
from __future__ import annotations

import importlib
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("sm90_compile needs TRITON_INTERPRET unset")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# import_module: the package re-exports functions under the same names as the modules.
bgmv = importlib.import_module("services.decoder.kernels.bgmv")
sgmv = importlib.import_module("services.decoder.kernels.sgmv")

TARGET = GPUTarget("cuda", 90, 32)
I32 = "i32"


def compile_one(fn, types: dict[str, str], consts: dict[str, object]) -> int:
    sig = dict(types)
    sig.update({k: "constexpr" for k in consts})
    kernel = triton.compile(ASTSource(fn, signature=sig, constexprs=consts), target=TARGET)
    return len(kernel.asm["cubin"])


def variants():
    for dt in ("fp16", "bf16", "fp32"):
        for br in (16, 64):
            yield ("bgmv_shrink", dt, br), bgmv._bgmv_shrink_kernel, {
                "X": f"*{dt}", "A": f"*{dt}", "SLOTS": "*i32", "T": "*fp32", "K": I32, "R": I32,
                "K_PER_SPLIT": I32, "stride_xn": I32, "stride_as": I32, "stride_ar": I32,
                "stride_ts": I32, "stride_tn": I32}, {"BLOCK_R": br, "BLOCK_K": 4096 // br}
            yield ("bgmv_expand", dt, br), bgmv._bgmv_expand_kernel, {
                "T": "*fp32", "B": f"*{dt}", "SLOTS": "*i32", "Y": f"*{dt}", "D": I32, "R": I32,
                "stride_ts": I32, "stride_tn": I32, "stride_bs": I32, "stride_bd": I32, "stride_yn": I32,
            }, {"NUM_SPLITS": 4, "BLOCK_R": br, "BLOCK_D": 4096 // br}
            for dot_fp32 in ((True,) if dt == "fp32" else (False, True)):
                yield ("sgmv_shrink", dt, br, dot_fp32), sgmv._sgmv_shrink_kernel, {
                    "X": f"*{dt}", "A": f"*{dt}", "SORTED_ROWS": "*i32", "TILE_START": "*i32",
                    "TILE_END": "*i32", "TILE_SLOT": "*i32", "T": "*fp32", "K": I32, "R": I32,
                    "K_PER_SPLIT": I32, "stride_xn": I32, "stride_as": I32, "stride_ar": I32,
                    "stride_ts": I32, "stride_tp": I32,
                }, {"BLOCK_M": 32, "BLOCK_R": br, "BLOCK_K": 128, "DOT_FP32": dot_fp32}
                yield ("sgmv_expand", dt, br, dot_fp32), sgmv._sgmv_expand_kernel, {
                    "T": "*fp32", "B": f"*{dt}", "SORTED_ROWS": "*i32", "TILE_START": "*i32",
                    "TILE_END": "*i32", "TILE_SLOT": "*i32", "Y": f"*{dt}", "D": I32, "R": I32,
                    "stride_ts": I32, "stride_tp": I32, "stride_bs": I32, "stride_bd": I32, "stride_yn": I32,
                }, {"NUM_SPLITS": 2, "BLOCK_M": 32, "BLOCK_R": br, "BLOCK_D": 128, "DOT_FP32": dot_fp32}


def main(quick: bool) -> None:
    for name, fn, types, consts in variants():
        # quick: one rank tile per dtype and kernel keeps the test run short.
        if quick and name[2] != 16:
            continue
        print(name, compile_one(fn, types, consts), "bytes of cubin", flush=True)
    print("ok")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
