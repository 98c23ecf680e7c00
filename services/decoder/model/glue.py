"""Which elementwise glue a CPU model runs between its matmuls: the C++ row ops or torch's, timed at load.

kernels/glue_cpu computes RMSNorm (with the residual add before it) and SiLU(gate) * up in one pass
each, where torch takes six ops per norm and two passes over strided halves for the activation. Which
is faster depends on the CPU and the dtype: on an Intel Xeon with AMX (family 6 model 167, 2 threads,
2,048 rows) the norm took 0.33 ms against torch's 0.88 in bf16 and 0.18 against 0.62 in fp32, the
activation 0.92 against 1.43 ms in fp32 but 1.9 against 1.35 in bf16 (torch's bf16 conversions are
single instructions there). So each op is timed both ways at the model's widths, and each module
runs the faster. Few-row decode steps run the decode stack instead (runner/fused_decode.py), which
uses the same C++ row functions; this serves prefill chunks and the steps the stack does not take.

TESSERA_GLUE=off keeps torch's ops (A/B benchmarks).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from services.common import native, stopwatch
from services.decoder.kernels import glue_cpu
from services.decoder.model.decoder import CausalLM

log = logging.getLogger("tessera.glue")

ENV = "TESSERA_GLUE"
ROWS, REPS = 512, 5       # a prefill chunk's worth of rows; best of REPS calls after a warm-up
WIN = 0.05                # the C++ op must be this much faster to be used

# (op: "norm" or "act", path: "cpp" or "torch", a call of that op on that path) -> seconds it takes.
Timer = Callable[[str, str, Callable[[], object]], float]


def best_of(op: str, path: str, fn: Callable[[], object]) -> float:
    return stopwatch.fastest(fn, REPS)


def choose(model: CausalLM, timer: Timer | None = None) -> str:
    """Time each op both ways and set the modules' `native` flags; one line for the log and
    GetModelInfo.glue, e.g. "norm cpp (0.18 vs 0.62 ms), silu*up torch (1.90 vs 1.35 ms) at 512 rows"."""
    reason = ineligible(model, ENV)
    if reason:
        return f"torch ({reason})"
    try:
        glue_cpu.load()
    except native.BuildError as e:
        log.warning("C++ glue unavailable, the model runs torch's elementwise ops: %s", e)
        return f"torch (unavailable: {str(e).splitlines()[0]})"
    timer = timer or best_of
    cfg, dtype = model.config, model.model.norm.weight.dtype
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, cfg.hidden_size, generator=gen).to(dtype)
    y = torch.randn(ROWS, cfg.hidden_size, generator=gen).to(dtype)
    gate, up = torch.randn(ROWS, 2 * cfg.intermediate_size, generator=gen).to(dtype).chunk(2, dim=1)
    norm = model.model.norm
    ops = {
        "norm": (lambda: glue_cpu.rms_norm(x, norm.weight, norm.eps, y),
                 lambda: glue_cpu.rms_norm_ref(x, norm.weight, norm.eps, y)),
        "act": (lambda: glue_cpu.silu_mul(gate, up), lambda: glue_cpu.silu_mul_ref(gate, up)),
    }
    wins, parts = {}, []
    with torch.inference_mode():
        for op, (cpp, ref) in ops.items():
            ours, theirs = timer(op, "cpp", cpp), timer(op, "torch", ref)
            wins[op] = ours * (1 + WIN) < theirs
            parts.append(f"{'norm' if op == 'norm' else 'silu*up'} {'cpp' if wins[op] else 'torch'} "
                         f"({ours * 1e3:.2f} vs {theirs * 1e3:.2f} ms)")
    model.use_native_glue(norm=wins["norm"], act=wins["act"])
    summary = ", ".join(parts) + f" at {ROWS} rows"
    log.info("glue: %s", summary)
    return summary


def ineligible(model: CausalLM, env: str) -> str:
    """Why C++ row ops (this glue, the decode stack) cannot run model here, or "": the switch `env`
    is off, the model is not on CPU, or its activations are neither float32 nor bfloat16."""
    if os.environ.get(env, "auto").strip().lower() == "off":
        return f"{env}=off"
    weight = model.model.norm.weight
    if weight.device.type != "cpu":
        return "not on CPU"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"{str(weight.dtype).removeprefix('torch.')} activations"
    return ""
