"""Which elementwise glue a CPU model runs between its matmuls: the C++ row ops or torch's, timed at load.

kernels/glue_cpu computes RMSNorm (with the residual add before it) and SiLU(gate) * up in one pass
each, where torch takes six ops per norm and two passes over strided halves for the activation. Which
is faster depends on the CPU and the dtype: on an Intel Xeon with AMX (family 6 model 167, 2 threads,
2,048 rows) the norm took 0.33 ms against torch's 0.88 in bf16 and 0.18 against 0.62 in fp32, the
activation 0.92 against 1.43 ms in fp32 but 1.9 against 1.35 in bf16 (torch's bf16 conversions are
single instructions there). So each op is timed both ways at the model's widths, and each module
runs the faster. Few-row decode steps run the decode stack instead (runner/fused_decode.py), which
uses the same C++ row functions; this serves prefill chunks and the steps the stack does not take.

The `glue` entry of --fast-paths pins both ops to cpp or torch (services/common/plan.py).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from services.common import native
from services.common import plan as execution
from services.decoder.kernels import glue_cpu
from services.decoder.model.decoder import CausalLM

log = logging.getLogger("tessera.glue")

ROWS = 512                # a prefill chunk's worth of rows

# {path: call} of one op -> {path: seconds}; plan.fastest unless a test swaps it.
Timer = Callable[[str, dict[str, Callable[[], object]]], dict[str, float]]


def best_of(op: str, calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    return execution.fastest(calls)


def choose(model: CausalLM, record: execution.ExecutionPlan, timer: Timer | None = None) -> str:
    """Set the modules' `native` flags per op (choices "glue.norm" and "glue.act" of record): the
    pinned path, else the faster by the plan's tie rule (torch kept on a tie). One line, e.g.
    "norm cpp (0.18 vs 0.62 ms), silu*up torch (1.90 vs 1.35 ms) at 512 rows"."""
    pin = record.pinned("glue")
    reason = "--fast-paths glue=torch" if pin == "torch" else ineligible(model)
    if reason:
        if pin == "cpp":
            raise ValueError(f"--fast-paths glue=cpp: the C++ glue cannot run this model ({reason})")
        for op in ("norm", "act"):
            record.record(f"glue.{op}", "torch", reason=reason)
        model.use_native_glue(norm=False, act=False)
        return f"torch ({reason})"
    try:
        glue_cpu.load()
    except native.BuildError as e:
        if pin == "cpp":
            raise
        log.warning("C++ glue unavailable, the model runs torch's elementwise ops: %s", e)
        for op in ("norm", "act"):
            record.record(f"glue.{op}", "torch", reason=f"unavailable: {str(e).splitlines()[0]}")
        return f"torch (unavailable: {str(e).splitlines()[0]})"
    # An op whose C++ form does not compute the family's math (CausalLM.unsupported) keeps torch's, pinned
    # or not; pinned, that is said at WARNING (one pin can serve a fleet of models).
    refused = {op: model.unsupported().get(f"glue.{op}", "") for op in ("norm", "act")}
    for op, why in refused.items():
        if why:
            record.record(f"glue.{op}", "torch", reason=why + (" (pinned on: not applicable to this model)"
                                                               if pin == "cpp" else ""),
                          level=logging.WARNING if pin == "cpp" else logging.INFO)
    if pin == "cpp":
        for op in ("norm", "act"):
            if not refused[op]:
                record.record(f"glue.{op}", "cpp")
        model.use_native_glue(norm=not refused["norm"], act=not refused["act"])
        return "cpp (--fast-paths glue=cpp)"
    timer = timer or best_of
    cfg, dtype = model.config, model.model.norm.weight.dtype
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, cfg.hidden_size, generator=gen).to(dtype)
    y = torch.randn(ROWS, cfg.hidden_size, generator=gen).to(dtype)
    gate, up = torch.randn(ROWS, 2 * cfg.intermediate_size, generator=gen).to(dtype).chunk(2, dim=1)
    norm = model.model.norm
    ops = {
        "norm": {"cpp": lambda: glue_cpu.rms_norm(x, norm.weight, norm.eps, y),
                 "torch": lambda: glue_cpu.rms_norm_ref(x, norm.weight, norm.eps, y)},
        "act": {"cpp": lambda: glue_cpu.silu_mul(gate, up), "torch": lambda: glue_cpu.silu_mul_ref(gate, up)},
    }
    wins, parts = {"norm": False, "act": False}, []
    with torch.inference_mode():
        for op, calls in ops.items():
            if refused[op]:
                parts.append(f"{'norm' if op == 'norm' else 'silu*up'} torch ({refused[op]})")
                continue
            took = timer(op, calls)
            chosen = execution.pick(took, "torch")
            wins[op] = chosen == "cpp"
            record.record(f"glue.{op}", chosen, [execution.Timing(p, t, ROWS) for p, t in took.items()])
            parts.append(f"{'norm' if op == 'norm' else 'silu*up'} {chosen} "
                         f"({took['cpp'] * 1e3:.2f} vs {took['torch'] * 1e3:.2f} ms)")
    model.use_native_glue(norm=wins["norm"], act=wins["act"])
    return ", ".join(parts) + f" at {ROWS} rows"


def ineligible(model: CausalLM) -> str:
    """Why C++ row ops (this glue, the decode stack) cannot run model here, or "": the model is not on
    CPU, or its activations are neither float32 nor bfloat16."""
    weight = model.model.norm.weight
    if weight.device.type != "cpu":
        return "not on CPU"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"{str(weight.dtype).removeprefix('torch.')} activations"
    return ""
