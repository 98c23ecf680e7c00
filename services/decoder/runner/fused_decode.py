"""Few-row decode steps through the C++ decode stack (kernels/decode_stack_cpu), where it is faster.

Besides its matmuls, each layer of a decode step is ~40 small torch ops (norms, rotary, cache
writes, SiLU, residual adds, views), whose dispatch costs about as much as the matmuls at batch 1
on a 2-core machine and ~15% of a 64-row step in bf16. The stack runs all layers of a decode
step in one call over the same weights and the same paged cache, each projection on the path its
Linear chose at load for that row count (gemv_cpu, packed or plain). A step takes it when:
- every row is a decode row of the in-place attention operator (no prefill span; a short chunk
  after 0, e.g. speculative drafts, and a short first chunk count as rows), at most `max_rows` of them;
- no row uses a LoRA adapter, unless the adapters live in the CPU pool (lora/pool.py): the stack then holds
  the pool's arenas (`attach_lora`, refreshed when the pool moved rows) and adds each row's corrections after
  each projection, as the layers' PoolLayer does;
- the model has no sliding-window layer and no attention soft-cap (the stack's attention has neither).
Any other step runs the model's own layers, which stay the reference (tests compare the two).

`FusedDecode.build` makes it at load, when the model is on CPU in float32 or bfloat16 (int8 and grouped weights
included, up to their few-row kernel's rows), the decode attention is the C++ operator, the matmul path is chosen by
timing, and the operator builds. It then times one step both ways at each of TIMING_ROWS and keeps
the largest count up to which the layers beat the stack (plan.beats) at none (`max_rows`), if the stack beat
the layers at one of them at least (else 0: never). Not "the stack beat the layers at every count": it runs the
same kernels with fewer dispatches, so at a few rows of a large model (a 1 B model's 30-50 ms step) it gains
less than the tie rule's margin, and a count where the two tied then kept the stack, and its panels, from every
larger count.
The `decode_stack` entry of --fast-paths (services/common/plan.py) pins it: off keeps it out (A/B
benchmarks), on takes it up to the largest timing row count without timing.

Where tile_gemm_cpu runs for the model's dtype (AVX-512; for bf16 the bf16 dot product), a second
stack runs the projections that fit (tile_gemm_cpu.fits) through it above 4 rows (TILES_ABOVE).
It is timed too, at every one of TIMING_ROWS from 2. Its panels would run above TILES_ABOVE and at the fewer
rows down to which they beat the few-row kernel at every timed count, but never at or below a count up to
gemv_cpu.MAX_ROWS where the few-row kernel beats them; the stack with them replaces the first only if it was faster
at every count above MAX_ROWS and by the plan's tie rule over the sum of the counts it would run (then its panel
copy of the weights stays resident; otherwise it is dropped). The `decode_panels`
entry of --fast-paths pins that copy: off never builds it, on keeps it whatever the timings; unpinned, it is built
only where it fits in half the memory available beside the KV cache (`_panels_refused`).
Over 30 layers of weights read from memory (a 64-row step), the panels ran 1.16-1.19x oneDNN's packed
GEMM in bf16 and 1.05-1.07x in fp32 on a Zen 4.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from services.common import native, tile_unit
from services.common import plan as execution
from services.decoder.kernels import decode_stack_cpu, gemv_cpu, tile_gemm_cpu, widen_gemm_cpu
from services.decoder.lora.pool import AdapterPool, PoolStep
from services.decoder.lora.store import AdapterStore
from services.decoder.model import glue
from services.decoder.model.decoder import CausalLM
from services.decoder.model.linear import Linear
from services.decoder.runner.attention import CPP, AttentionPlan, PagedAttention, Workspace
from services.decoder.runner.batch import StepBatch
from services.decoder.runner.kv_cache import KVCache
from services.decoder.runner.windows import binding

log = logging.getLogger("tessera.decode_stack")

# The paths are timed in interleaved rounds (plan.fastest), so a burst of load on a shared 2-core
# instance during one path's calls cannot decide alone.
TIMING_ROWS, TIMING_CONTEXT = (1, 2, 3, 4, 5, 6, 8, 16, 64), 64


class FusedDecode:
    def __init__(self, model: CausalLM, stack, tiled=None, panels_pinned: bool = False):
        self.model, self.stack = model, stack
        self.tiled = tiled          # the stack with tile_gemm_cpu projections, until choose() decides
        self.tiles = False          # whether self.stack is that one
        self.tiles_above = decode_stack_cpu.TILES_ABOVE     # its panels run above this many rows
        self.panels_pinned = panels_pinned  # decode_panels=on: the tiled stack is kept whatever its timings
        self.max_rows = 0
        self.pool: AdapterPool | None = None    # the adapter store whose arenas the stack holds
        self.pool_version = -1                  # the pool's version when the stack last took its arenas
        # The layers' int8 and grouped projections run in the stack as their Linear runs them: the few-row kernels up
        # to their gemv_rows, widen_gemm's tiles or amx above where that is their many-row path; the library paths
        # above them differ, so such a projection caps the stack's rows (the LM head is not the stack's).
        self.timing_rows = tuple(r for r in TIMING_ROWS if r <= _quantized_rows(model))

    @classmethod
    def build(cls, model: CausalLM, cache: KVCache, attention_backend: str, record: execution.ExecutionPlan,
              timer: Timer | None = None) -> tuple[FusedDecode | None, str]:
        """(the stack or None, a one-line summary), the choice "decode_stack" of record; timer (tests)
        replaces the clock in choose."""
        pin = record.pinned("decode_stack")
        reason = "--fast-paths decode_stack=off" if pin == "off" else \
            _ineligible(model, cache, attention_backend, record)
        if reason:
            if pin == "on":
                raise ValueError(f"--fast-paths decode_stack=on: the decode stack cannot run here ({reason})")
            record.record("decode_stack", "off", reason=reason)
            _no_panels(record, "the decode stack is off")
            return None, f"off ({reason})"
        try:
            stack = decode_stack_cpu.make_stack(_shape(model), _layers(model, cache), model.model.norm.weight)
        except native.BuildError as e:
            if pin == "on":
                raise
            log.warning("decode stack unavailable, decode steps run the model's layers: %s", e)
            record.record("decode_stack", "off", reason=f"unavailable: {str(e).splitlines()[0]}")
            _no_panels(record, "the decode stack is off")
            return None, f"off (unavailable: {str(e).splitlines()[0]})"
        if pin == "on":
            fused = cls(model, stack)
            fused.max_rows = fused.timing_rows[-1]
            record.record("decode_stack", f"on rows<={fused.max_rows}")
            _no_panels(record, "the decode stack is pinned on, untimed, without them")
            return fused, f"cpp rows<={fused.max_rows} (--fast-paths decode_stack=on)"
        panels = record.pinned("decode_panels")
        tiled, refused = None, _panels_refused(model, cache, panels)
        if not refused:
            layers = _layers(model, cache, tiles=True)
            if any(p.tiles is not None for w in layers for p in (w.qkv, w.o, w.gate_up, w.down)):
                tiled = decode_stack_cpu.make_stack(_shape(model), layers, model.model.norm.weight)
            else:
                refused = "no projection of the layers fits the panels"
        fused = cls(model, stack, tiled, panels_pinned=panels == "on")
        timings, measured = fused.choose(cache, timer)
        summary = (f"cpp rows<={fused.max_rows}" if fused.max_rows else "off (the layers were as fast)") + \
            f"; timed {timings}"
        record.record("decode_stack", f"on rows<={fused.max_rows}" if fused.max_rows else "off", measured)
        if refused or not fused.max_rows:
            _no_panels(record, refused or "the decode stack is off (the layers were as fast)")
        else:   # its timings are in the decode_stack choice, as "on (panels)"
            record.record("decode_panels", f"on from {fused.tiles_above + 1} rows" if fused.tiles else "off")
        return (fused if fused.max_rows else None), summary

    def attach_lora(self, store: AdapterStore) -> None:
        """Run adapter rows in the stack when `store` is the CPU pool; other stores (the CUDA bank) keep such
        steps on the layers."""
        if isinstance(store, AdapterPool):
            self.pool, self.pool_version = store, -1
            self.stack.set_lora_reading(store.grain, store.prefetch)

    def applies(self, batch: StepBatch) -> bool:
        plan = batch.plan
        return (not plan.prefills and plan.decode_rows is not None and plan.decode_rows.rows is None
                and len(batch.input_ids) <= self.max_rows and (not batch.lora_spans or self.pool is not None))

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
                 adapters: PoolStep | None = None) -> torch.Tensor:
        """embeds [M, hidden] (consumed) -> final-normed hidden states [M, hidden], as CausalLM.forward.
        adapters: the pool's step (AdapterPool.activate) when rows use adapters, else None."""
        if adapters is not None and self.pool is not None and self.pool.version != self.pool_version:
            # Rows moved or an arena was reallocated since the last step (only ever between steps).
            decode_stack_cpu.set_arenas(self.stack, self.pool.arenas())
            self.pool_version = self.pool.version
        return self._run(self.stack, embeds, positions, plan, adapters)

    def _run(self, stack, embeds: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
             adapters: PoolStep | None = None) -> torch.Tensor:
        cos, sin = self.model.rotary.cos_sin(positions, embeds.dtype)       # [M, 1, D]
        d = plan.decode_rows
        offsets, ranks = (adapters.offsets, adapters.ranks) if adapters is not None else (None, None)
        return decode_stack_cpu.decode_stack(stack, embeds.contiguous(), cos[:, 0], sin[:, 0],
                                             plan.slot_mapping, d.block_tables, d.context_lens, offsets, ranks)

    @torch.inference_mode()
    def choose(self, cache: KVCache, timer: Timer | None = None) -> tuple[str, list[execution.Timing]]:
        """Time a decode step of r rows both ways (and on the tiled stack, from 2 rows) for each r in
        timing_rows, in order, over blocks of the runner's own cache (zeroed again afterwards: no request
        owns a block at load), at TIMING_CONTEXT keys or what the cache holds. Sets max_rows and which
        stack runs; returns the timings in words, e.g. "1 row 9.1 vs 14.0 ms; ...; 64 rows 60.1 (tiles 51.0) vs
        ...", and as the plan's records. timer (tests): (path, rows, call) -> seconds, else plan.fastest."""
        bs, largest = cache.block_size, self.timing_rows[-1]
        per_row = max(1, min(-(-TIMING_CONTEXT // bs), cache.num_blocks // largest))
        context = min(TIMING_CONTEXT, per_row * bs)
        timed = []                  # (rows, best seconds per path)
        if self.tiled is not None:
            self.tiled.set_tiles_above(1)       # timed from 2 rows: the panels may win below TILES_ABOVE too
        for rows in self.timing_rows:
            if rows * per_row > cache.num_blocks:
                break
            steps = self._steps(cache, rows, context, per_row)
            best = execution.fastest(steps) if timer is None else \
                {name: timer(name, rows, fn) for name, fn in steps.items()}
            timed.append((rows, best))
            if execution.beats(best["layers"], min(best["stack"], best.get("tiles", math.inf))):
                break
        for k, v in zip(cache.k, cache.v, strict=True):
            k[:largest * per_row].zero_()
            v[:largest * per_row].zero_()
        # The fewer rows they would also run at: down from TILES_ABOVE while they beat the few-row kernel
        # (plan.beats) at every timed count. On a Zen 4 (family 25 model 17) an fp32 SmolLM2 step of 3-4 rows took
        # 13.9-14.1 ms on them against 15.6-20.6 on the few-row kernel, which reads the weights at a fraction of the
        # machine's rate once more than two rows of x compete for L1 beside them. And never at or below a count of the
        # few-row kernel's (up to gemv_cpu.MAX_ROWS) where it beats them: on an Intel Xeon (family 6 model 167) the
        # same step of 5 rows (a verification of 4 drafts) took 26.3 ms on them against 22.8, though they won from 8.
        few = {rows: best for rows, best in timed if "tiles" in best and rows <= decode_stack_cpu.TILES_ABOVE}
        above = self.tiles_above
        while above > 1 and above in few and execution.beats(few[above]["tiles"], few[above]["stack"]):
            above -= 1
        lose = [rows for rows, best in timed if "tiles" in best and rows <= gemv_cpu.MAX_ROWS
                and execution.beats(best["stack"], best["tiles"])]
        if not self.panels_pinned:  # pinned on, they run from TILES_ABOVE + 1 rows at the latest
            above = max([above] + lose)
        tiled = [best for rows, best in timed if "tiles" in best and rows > gemv_cpu.MAX_ROWS]
        runs = [best for rows, best in timed if "tiles" in best and rows > above]
        # Kept, the panels are one more copy of the weights: so they must be faster at every timed row count above
        # the few-row kernel's, and by the tie rule over every count they would run at. By the tie rule at each
        # count, the choice at 64 rows (where they gain least, 6-9% at load on a Zen 4) flipped with the machine's noise
        # from run to run. The few-row counts are in the sum: on a Zen 5 (family 26 model 2) a bf16 step of
        # Llama-3.2-1B's shape took 24.7-28.0 ms on them at 2-4 rows against 28.5-36.5, but only 3.7% less over 16
        # and 64 rows, which alone had dropped them (and 4-row steps then took 56 ms instead of 39-43).
        self.tiles = bool(tiled) and (self.panels_pinned or all(best["tiles"] < best["stack"] for best in tiled) and
                                      execution.beats(sum(best["tiles"] for best in runs),
                                                      sum(best["stack"] for best in runs)))
        if self.tiles:
            self.tiles_above = above
            self.tiled.set_tiles_above(above)
            self.stack = self.tiled
        self.tiled = None           # the losing stack (and its panels, if they lost) is freed
        detail, self.max_rows, won = [], 0, False
        for rows, best in timed:
            tiles = f" (tiles {best['tiles'] * 1e3:.1f})" if "tiles" in best else ""
            detail.append(f"{rows} row{'s' if rows > 1 else ''} {best['stack'] * 1e3:.1f}{tiles} vs "
                          f"{best['layers'] * 1e3:.1f} ms")
            ours = best["tiles"] if self.tiles and "tiles" in best and rows > self.tiles_above else best["stack"]
            if execution.beats(best["layers"], ours):
                break
            won = won or execution.beats(ours, best["layers"])
            self.max_rows = rows
        if not won:
            self.max_rows = 0
        names = {"stack": "on", "tiles": "on (panels)", "layers": "off"}
        measured = [execution.Timing(names[name], t, rows) for rows, best in timed for name, t in best.items()]
        tiles = f"on from {self.tiles_above + 1} rows" if self.tiles else "off" if tiled else "n/a"
        return "; ".join(detail) + f" (stack vs layers; tiles {tiles})", measured

    def _steps(self, cache: KVCache, rows: int, context: int, per_row: int) -> dict[str, Callable[[], object]]:
        """One step of `rows` decode rows at `context` keys, row r on blocks [r * per_row, (r + 1) * per_row),
        on each path."""
        spans = [(context - 1, 1, list(range(r * per_row, (r + 1) * per_row))) for r in range(rows)]
        plan = AttentionPlan.build(spans, cache.block_size, torch.device("cpu"), CPP)
        positions = torch.full((rows,), context - 1, dtype=torch.long)
        embeds = torch.randn(rows, self.model.config.hidden_size).to(cache.k[0].dtype)
        steps = {"stack": lambda: self(embeds.clone(), positions, plan),
                 "layers": lambda: self.model(embeds.clone(), positions, PagedAttention(cache, plan, Workspace()))}
        if self.tiled is not None and rows > 1:
            steps["tiles"] = lambda: self._run(self.tiled, embeds.clone(), positions, plan)
        return steps


# (path: "stack", "tiles" or "layers", rows, a call of one step on that path) -> seconds it takes.
Timer = Callable[[str, int, Callable[[], object]], float]


def _ineligible(model: CausalLM, cache: KVCache, attention_backend: str, record: execution.ExecutionPlan) -> str:
    """Why the stack cannot run this model here, or "" when it can."""
    # The stack computes Llama's layer (and Qwen's biases and per-head q/k norms): a family whose math
    # differs says so (CausalLM.unsupported) and decodes through its own layers.
    reason = model.unsupported().get("decode_stack", "") or glue.ineligible(model)
    if reason:
        return reason
    cfg = model.config
    # The stack's attention reads every key of a row with plain softmax scores.
    if binding(cfg.layer_windows, cache.num_blocks * cache.block_size):
        return "the C++ decode stack attends to the whole context; this model has sliding-window layers"
    if cfg.attn_softcap is not None:
        return "the C++ decode stack has no attention soft-cap (attn_softcap)"
    if attention_backend != CPP:
        return f"decode attention is {attention_backend}"
    if record.pinned("linear") != execution.AUTO:
        return f"the matmul path is pinned (--fast-paths linear={record.pinned('linear')})"
    if not _quantized_rows(model):
        return ("a quantized projection runs neither the few-row kernel (gemv off) nor widen_gemm_cpu's many-row "
                "matmul")
    for layer in model.model.layers:
        if layer.self_attn.qkv is None or layer.mlp.gate_up is None:
            return "projections not fused"
    return ""


def _panels_refused(model: CausalLM, cache: KVCache, pin: str) -> str:
    """Why the layers get no panel copy ("" when they do): pinned off, no panel kernel for their dtype here, or, not
    pinned on, a copy of their dense projections larger than half the memory the kernel reports available, less the
    KV cache (whose pages are taken as they are first written)."""
    dtype = model.model.norm.weight.dtype
    if pin == "off":
        return "--fast-paths decode_panels=off"
    if not (tile_gemm_cpu.available(dtype) or dtype == torch.bfloat16 and tile_unit.amx()):
        return f"no panel kernel for {str(dtype).removeprefix('torch.')} weights on this CPU"
    need = sum(m.weight.numel() * m.weight.element_size() for layer in model.model.layers
               for m in (layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj)
               if m.qweight is None and m.grouped is None)
    free = available_memory()
    if free is not None:
        free -= sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
    if pin == execution.AUTO and free is not None and need > free / 2:
        return (f"a panel copy of the layers' weights ({need / 2 ** 30:.1f} GiB) would take more than half the memory "
                f"available beside the KV cache ({free / 2 ** 30:.1f} GiB); --fast-paths decode_panels=on builds it "
                "anyway")
    return ""


# A container's memory limit and use (cgroup v2, then v1): MemAvailable counts the whole host's.
CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_memory() -> int | None:
    """Bytes the kernel reports available (MemAvailable in /proc/meminfo), or less where this process's cgroup
    allows less (its limit less its use); None where neither says."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in CGROUP_FILES:
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit, usage = f.read().strip(), int(g.read())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2 ** 60:   # "max", or v1's page-rounded 2^63: no limit
            found.append(max(0, int(limit) - usage))
        break
    return min(found, default=None)


def _no_panels(record: execution.ExecutionPlan, why: str) -> None:
    """The choice "decode_panels" when the panels are never built; said at WARNING when they were pinned on."""
    pinned = record.pinned("decode_panels") == "on"
    record.record("decode_panels", "off", reason=why + (" (pinned on: not applicable)" if pinned else ""),
                  level=logging.WARNING if pinned else logging.INFO)


def _shape(model: CausalLM) -> decode_stack_cpu.Shape:
    cfg = model.config
    return decode_stack_cpu.Shape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                                  cfg.intermediate_size, cfg.rms_norm_eps)


def _projection(linear: Linear, tiles: bool) -> decode_stack_cpu.Projection:
    """The stack's view of a Linear; with tiles, a weight that fits gets its tile_gemm_cpu panels for
    every row count above the few-row kernel's."""
    widen, kernel = _widen(linear)
    if linear.qweight is not None:
        return decode_stack_cpu.Projection(linear.qweight, linear.qscale, linear.bias, linear.gemv_rows, widen=widen,
                                           kernel=kernel, prefetch=linear.gemv_prefetch, streams=linear.gemv_streams)
    if linear.grouped is not None:
        gw = linear.grouped
        return decode_stack_cpu.Projection(gw.codes, gw.scale, linear.bias, linear.gemv_rows, offset=gw.offset,
                                           bits=gw.bits, group=gw.group, widen=widen, kernel=kernel,
                                           grouped_loop=linear.grouped_loop, prefetch=linear.gemv_prefetch,
                                           streams=linear.gemv_streams)
    rule = linear.rule
    # bf16 on a CPU with the tile unit: its panels (AVX-512's bf16 dot product ran a 16-row step's projections at a
    # third of the library's speed on an Intel Xeon with AMX); else tile_gemm_cpu's where the weight fits.
    amx = tiles and linear.weight.dtype == torch.bfloat16 and tile_unit.amx()
    panels = tile_unit.pack_panels(linear.weight) if amx else \
        tile_gemm_cpu.pack(linear.weight) if tiles and tile_gemm_cpu.fits(linear.weight) else None
    return decode_stack_cpu.Projection(linear.weight, None, linear.bias, linear.gemv_rows, linear.packed,
                                       (rule.starts, rule.packed) if rule is not None else ((1,), (False,)),
                                       panels, linear.bf16_row, tiles_amx=amx, prefetch=linear.gemv_prefetch,
                                       streams=linear.gemv_streams)


def _quantized_rows(model: CausalLM) -> float:
    """The most rows every int8 and grouped projection of the layers runs as its Linear does in the stack: its
    gemv_rows, unbounded where its many-row path is widen_gemm_cpu's."""
    return min((math.inf if _widen(m)[0] is not None else m.gemv_rows for m in model.model.layers.modules()
                if isinstance(m, Linear) and (m.qweight is not None or m.grouped is not None)), default=math.inf)


def _widen(linear: Linear) -> tuple[torch.dtype | None, str]:
    """(products' dtype, widen_gemm_cpu kernel) of an int8 or grouped Linear whose many-row path is widen_gemm_cpu
    (`tiles`: "dot"; `amx`: bf16 on the tile unit), else (None, "dot")."""
    path = linear.int8_gemm if linear.qweight is not None else linear.grouped_path
    if path not in widen_gemm_cpu.PATH_KERNELS:
        return None, "dot"
    kernel = widen_gemm_cpu.PATH_KERNELS[path]
    return widen_gemm_cpu.products_for(linear.weight.dtype, kernel), kernel


def _layers(model: CausalLM, cache: KVCache, tiles: bool = False) -> list[decode_stack_cpu.LayerWeights]:
    out = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        out.append(decode_stack_cpu.LayerWeights(
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            _projection(attn.qkv, tiles), _projection(attn.o_proj, tiles), _projection(mlp.gate_up, tiles),
            _projection(mlp.down_proj, tiles),
            cache.k[i], cache.v[i],
            attn.q_norm.weight if attn.q_norm is not None else None,
            attn.k_norm.weight if attn.k_norm is not None else None))
    return out
