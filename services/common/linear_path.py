"""The CPU matmul path per weight shape: oneDNN-packed or plain F.linear, chosen by timing.

Neither path wins everywhere. A weight reordered once into oneDNN's
blocked layout (torch.ops.mkldnn, the ops inductor uses for frozen CPU linears) ran ~2x
faster than F.linear at every row count on an AMD Zen 4, but 2-3x slower at 1 row on an
Intel Emerald Rapids (faster again at 64 rows), and on AVX2-only CPUs oneDNN cannot pack
bf16 at all. There a bf16 weight is packed widened to fp32 instead (`pack_dtype`): such CPUs
have no bf16 GEMM, and on a Zen 3 the plain bf16 F.linear ran 3-6x slower than the widened
packed one at 16-64 rows. Widening is exact and both sum the products in fp32, so that path
is the same function; the packed copy then takes twice the bf16 weight's memory. Where oneDNN
packs both, a bf16 shape's packed copy is itself chosen by timing (`choose_copies`): on an Intel
Emerald Rapids without AMX the widened one ran 1.3-1.7x faster at 64-2048 rows. So at load,
for each distinct (out, in, dtype, bias) shape, both paths are timed at a few row counts on
the real weight with the configured threads, and each shape gets a `Rule`: which path runs
for a given number of rows. Both the dense weight and the
packed copy stay resident while any row count uses the packed one.

The `mode` argument (the `linear` entry of --fast-paths, services/common/plan.py) = auto | packed |
plain; packed and plain force one path (tests, debugging), auto measures, with the plan's timer and
tie rule.
"""
from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from services.common import plan as execution

log = logging.getLogger("tessera.linear_path")

MODES = ("auto", "packed", "plain")
# Decode batch 1, small and large decode batches, a prefill chunk.
ROWS = (1, 4, 16, 64, 256)
# Buckets above the first cost at most this many multiply-adds per call (about 10-20 ms in
# fp32 on 2 cores): a 49152-wide LM head is timed up to 64 rows, the decode batch it serves
# (it only sees sampled rows), a 151936x1536 one at 1 and 4 only; larger row counts keep the
# last measured verdict.
MAX_MACS = 1 << 31
# Every (shape, rows) is timed in PASSES passes (see measure_rules); each pass runs interleaved
# rounds for about PASS_S, at least one and at most MAX_REPS (the first pass is the warm-up).
PASSES, PASS_S, MAX_REPS = 3, 1e-3, 16
# Rows at which a bf16 weight's two packed copies (its own, and widened to fp32) are timed against
# each other where oneDNN packs both (their totals count): a large decode batch and a prefill chunk.
# On an Intel Emerald Rapids without AMX, oneDNN's bf16 GEMM ran 1.3-1.7x slower than its fp32 one
# on the same widened weights at 64-2048 rows (and tied at 16); where bf16 GEMMs are fast, the own
# copy wins and nothing changes.
COPY_ROWS = (64, 256)
# Passes for that choice: one packed copy then serves every row count, so it gets more than a rule's.
COPY_PASSES = 5


@dataclass(frozen=True)
class Shape:
    out_features: int
    in_features: int
    dtype: torch.dtype
    bias: bool

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Shape:
        return cls(weight.shape[0], weight.shape[1], weight.dtype, bias is not None)

    def __str__(self) -> str:
        return f"{self.out_features}x{self.in_features}{'+b' if self.bias else ''}"


@dataclass(frozen=True)
class Rule:
    """Rows in [starts[i], starts[i+1]) use the packed path iff packed[i]; starts[0] == 1."""

    starts: tuple[int, ...]
    packed: tuple[bool, ...]

    @classmethod
    def always(cls, packed: bool) -> Rule:
        return cls((1,), (packed,))

    @classmethod
    def from_verdicts(cls, verdicts: Iterable[tuple[int, bool | None]]) -> Rule:
        """[(rows, packed wins, or None for a tie under plan.tied)] in ascending rows -> a Rule.

        A tie takes the verdict of the bucket below it (the first decisive one above it
        for leading ties; plain, which needs no packed copy, when all tie), so noise
        between two equal paths does not split a shape into many runs.
        """
        verdicts = list(verdicts)
        last = next((v for _, v in verdicts if v is not None), False)
        starts, packed = [], []
        for rows, wins in verdicts:
            last = last if wins is None else wins
            if not packed or packed[-1] != last:
                starts.append(rows)
                packed.append(last)
        starts[0] = 1
        return cls(tuple(starts), tuple(packed))

    def use_packed(self, rows: int) -> bool:
        return self.packed[bisect.bisect_right(self.starts, rows) - 1]

    @property
    def ever_packed(self) -> bool:
        return any(self.packed)

    def __str__(self) -> str:
        if len(self.packed) == 1:
            return "packed" if self.packed[0] else "plain"
        if self.packed == (False, True):
            return f"packed rows>={self.starts[1]}"
        ends = self.starts[1:] + (None,)
        return "packed rows " + ",".join(f"{lo}-{'' if hi is None else hi - 1}"
                                         for lo, hi, p in zip(self.starts, ends, self.packed, strict=True) if p)


@dataclass(frozen=True)
class Plan:
    """The rule per weight shape, and a one-line summary (logged; runner.linear_backend)."""

    mode: str
    rules: dict[Shape, Rule]
    reason: str = ""
    copies: dict[Shape, torch.dtype] = field(default_factory=dict)   # packed-copy dtype, where timed

    def rule(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Rule:
        return self.rules.get(Shape.of(weight, bias), Rule.always(False))

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """weight's packed copy, in the dtype this plan chose for its shape (else pack_dtype's)."""
        return pack(weight, self.copies.get(Shape.of(weight, bias)))

    @property
    def summary(self) -> str:
        """e.g. "auto float32: packed on 576x576,1536x576; packed rows>=16 on 192x576", or
        "auto bfloat16: plain on 576x576 (oneDNN cannot pack bfloat16 here: ...)"."""
        if not self.rules:
            return f"{self.mode}: plain (no CPU weights)"
        groups: dict[str, list[str]] = {}
        for shape, rule in self.rules.items():
            groups.setdefault(str(rule), []).append(str(shape))
        dtypes = sorted({str(s.dtype).removeprefix("torch.") for s in self.rules})
        body = "; ".join(f"{r} on {','.join(s)}" for r, s in groups.items())
        return f"{self.mode} {'/'.join(dtypes)}: {body}" + (f" ({self.reason})" if self.reason else "")


# Where a measurement comes from: (weight, packed, bias, rows) -> (plain s, packed s).
Timer = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", int], tuple[float, float]]
# (weight, own packed copy, widened packed copy, bias, rows) -> (own s, widened s).
CopyTimer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", int], tuple[float, float]]


def available(device: torch.device | str = "cpu") -> bool:
    """True where packed matmuls can run: CPU tensors and a torch built with oneDNN."""
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight [out, in] -> an opaque packed copy for `packed_linear`, in dtype (default
    pack_dtype(weight.dtype); a Plan passes the copy it timed for the shape)."""
    dtype = dtype or pack_dtype(weight.dtype)
    if dtype is None:
        raise RuntimeError(pack_error(weight.dtype))
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype))


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  gelu: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, in] @ weight.T + bias -> [N, out] in x's dtype, weight given as `pack(weight)`. A widened
    bf16 weight (packed as fp32) gets x and bias widened and its fp32 result rounded once to x's dtype.
    gelu: F.gelu's `approximate` ("none" or "tanh") applied to the result; residual [N, out]: added to it. Both
    are oneDNN post-ops on the GEMM's output tiles while they are in cache, not another pass over [N, out]
    (a residual after a GELU excepted): on MiniLM's encoder (2,000 sentences, Intel Xeon family 6 model 167)
    3-6% less time, and bit-equal output there."""
    own = packed.dtype == x.dtype
    if own and residual is not None and gelu is None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
    post, algorithm = ("none", "") if gelu is None else ("gelu", gelu)
    wide = packed.dtype
    y = torch.ops.mkldnn._linear_pointwise(x if own else x.to(wide), packed,
                                           bias if own or bias is None else bias.to(wide), post, [], algorithm)
    y = y if own else y.to(x.dtype)
    return y if residual is None else y + residual


def pack_error(dtype: torch.dtype) -> str | None:
    """Why this CPU cannot run packed matmuls in dtype, or None when it can."""
    if not available("cpu"):
        return "torch has no oneDNN linear ops"
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
        packed_linear(torch.zeros(1, 8, dtype=dtype), w, None)
    except RuntimeError as exc:
        # e.g. bf16 on AVX2-only CPUs: "bf16 path needs the cpu support avx_ne_convert or
        # avx512bw, avx512vl and avx512dq".
        return f"oneDNN cannot pack {str(dtype).removeprefix('torch.')} here: {str(exc).splitlines()[0]}"
    return None


def pack_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype weights of `dtype` are packed in here: their own where oneDNN packs it; float32 for
    bfloat16 where only fp32 packs (AVX2-only CPUs; see the module docstring); else None."""
    if pack_error(dtype) is None:
        return dtype
    if dtype == torch.bfloat16 and pack_error(torch.float32) is None:
        return torch.float32
    return None


def resolve_mode(mode: str | None = None) -> str:
    """mode, else "auto"; ValueError names the bad value."""
    value = (mode or "auto").strip().lower()
    if value not in MODES:
        raise ValueError(f"linear path {value!r}: expected one of {', '.join(MODES)}")
    return value


def buckets(shape: Shape) -> tuple[int, ...]:
    """The ROWS that shape is timed at: the first always, the others within MAX_MACS."""
    macs = shape.out_features * shape.in_features
    return tuple(rows for i, rows in enumerate(ROWS) if i == 0 or rows * macs <= MAX_MACS)


@torch.inference_mode()
def time_both(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
              rows: int) -> tuple[float, float]:
    """Seconds per call (plain, packed) for x [rows, in]: plan.fastest over the rounds that fit in
    PASS_S (at least one)."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    return _fastest_pair(lambda: F.linear(x, weight, bias), lambda: packed_linear(x, packed, bias))


@torch.inference_mode()
def time_copies(weight: torch.Tensor, own: torch.Tensor, wide: torch.Tensor, bias: torch.Tensor | None,
                rows: int) -> tuple[float, float]:
    """Seconds per call (own packed copy, widened packed copy) for x [rows, in], as time_both."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    return _fastest_pair(lambda: packed_linear(x, own, bias), lambda: packed_linear(x, wide, bias))


def _fastest_pair(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float]:
    # No warm-up call here: measure_rules' first pass is the warm-up of each (shape, rows).
    best = execution.fastest({"a": first, "b": second}, MAX_REPS, warm=False, budget_s=PASS_S)
    return best["a"], best["b"]


def choose_copies(entries: dict[Shape, tuple[torch.Tensor, torch.Tensor | None]],
                  timer: CopyTimer | None = None) -> dict[Shape, torch.Tensor]:
    """{bf16 shape: (weight, bias)} -> {shape: its packed copy}: widened to fp32 where that took less
    time than its own by plan.beats, over COPY_ROWS (each the fastest of COPY_PASSES passes), else
    its own. The rule is then timed on that very copy."""
    timer = timer or time_copies
    copies = {shape: (pack(w, shape.dtype), pack(w, torch.float32)) for shape, (w, _) in entries.items()}
    best = {(shape, rows): (math.inf, math.inf) for shape in entries for rows in COPY_ROWS
            if rows in buckets(shape)}   # within MAX_MACS, as the rule's own timings
    for _ in range(COPY_PASSES):
        for shape, rows in best:
            w, b = entries[shape]
            own, wide = timer(w, *copies[shape], b, rows)
            best[shape, rows] = (min(best[shape, rows][0], own), min(best[shape, rows][1], wide))
    total = {shape: [0.0, 0.0] for shape in entries}
    for (shape, _), times in best.items():
        total[shape] = [total[shape][i] + times[i] for i in (0, 1)]
    return {shape: copies[shape][1] if execution.beats(wide, own) else copies[shape][0]
            for shape, (own, wide) in total.items()}


def measure_rules(entries: dict[Shape, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                  timer: Timer | None = None) -> dict[Shape, tuple[Rule, list[tuple[int, float, float]]]]:
    """{shape: (weight, packed, bias)} -> {shape: (rule, [(rows, plain s, packed s)])}.

    Every (shape, rows) is timed once per pass, PASSES passes round all of them, keeping
    the fastest of each: a burst of load from another process (on a busy 2-core VM every
    threaded call then waits out 4-8 ms scheduler ticks) spoils one pass, not the choice. The first
    pass doubles as warm-up (oneDNN builds its primitive on the first call). Packed runs
    where it was faster by plan.beats; where the two tie (plan.tied) the verdict is the bucket's below.
    """
    timer = timer or time_both   # looked up per call, so tests can swap the module's timer
    best = {(shape, rows): (math.inf, math.inf) for shape in entries for rows in buckets(shape)}
    for _ in range(PASSES):
        for shape, rows in list(best):
            plain, packed = timer(*entries[shape], rows)
            best[shape, rows] = (min(best[shape, rows][0], plain), min(best[shape, rows][1], packed))
    out = {}
    for shape in entries:
        timings = [(rows, *best[shape, rows]) for rows in buckets(shape)]
        verdicts = ((rows, None if execution.tied(q, p) else p < q) for rows, q, p in timings)
        out[shape] = (Rule.from_verdicts(verdicts), timings)
    return out


def plan(weights: Iterable[tuple[torch.Tensor, torch.Tensor | None]], mode: str | None = None,
         timer: Timer | None = None, copy_timer: CopyTimer | None = None,
         record: execution.ExecutionPlan | None = None) -> Plan:
    """Choose a rule per distinct shape of weights [(weight [out, in], bias [out] | None)].

    mode: auto | packed | plain, default the `linear` pin of `record` (else auto). Each shape is timed
    on its first weight; the plan is logged in one line (the timings at DEBUG), and with `record` each
    shape's rule is one choice of that execution plan ("linear 576x576", with its timings). Under auto,
    a bf16 shape that oneDNN packs in bf16 and in fp32 first gets the faster of the two packed copies
    (choose_copies); the packed-vs-plain rule is then timed on it.
    """
    pinned = record.pinned("linear") if record is not None else execution.AUTO
    mode = resolve_mode(mode or pinned)
    first: dict[Shape, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for w, b in weights:
        if w.device.type == "cpu":   # elsewhere F.linear is the only path
            first.setdefault(Shape.of(w, b), (w.detach(), None if b is None else b.detach()))
    packs = {d: pack_dtype(d) for d in {s.dtype for s in first}} if mode != "plain" else {}
    errors = {d: pack_error(d) for d, to in packs.items() if to is None}
    widened = sorted(str(d).removeprefix("torch.") for d, to in packs.items() if to not in (None, d))
    start = time.perf_counter()
    # Only shapes whose rule is timed at COPY_ROWS[0] too: one packed copy serves every row count,
    # and a shape timed at few rows only must keep the copy that wins there.
    both = {shape: wb for shape, wb in first.items()
            if mode == "auto" and packs.get(shape.dtype) == torch.bfloat16 and COPY_ROWS[0] in buckets(shape)
            and pack_error(torch.float32) is None}
    chosen = choose_copies(both, copy_timer) if both else {}
    copies = {shape: torch.float32 for shape, packed in chosen.items() if packed.dtype == torch.float32}
    rules, timed = {}, {}
    for shape, (w, b) in first.items():
        err = errors.get(shape.dtype)
        if mode != "auto" or err:
            rules[shape] = Rule.always(mode == "packed" and not err)
        else:
            timed[shape] = (w, chosen[shape] if shape in chosen else pack(w), b)
    measured = measure_rules(timed, timer) if timed else {}
    rules.update((shape, rule) for shape, (rule, _) in measured.items())
    rules = {shape: rules[shape] for shape in first}   # the model's order, for the summary
    details = [f"{shape}: " + " ".join(f"{r}:{q * 1e6:.0f}/{p * 1e6:.0f}" for r, q, p in timings)
               for shape, (_, timings) in measured.items()]
    notes = sorted({e for e in errors.values() if e})
    if notes:
        log.warning("linear path: plain F.linear where packing is impossible: %s", "; ".join(notes))
    notes += [f"{d} packed widened to float32" for d in widened]
    kept = {shape: copies[shape] for shape in first if shape in copies and rules[shape].ever_packed}
    if kept:
        notes.append(f"bfloat16 packed widened to float32 on {','.join(map(str, kept))}: faster at "
                     f"{'/'.join(map(str, COPY_ROWS))} rows")
    result = Plan(mode, rules, "; ".join(notes), kept)
    if record is not None and not rules:
        record.record("linear", "plain", reason="no CPU weights: F.linear is the only path")
    if record is not None:
        for shape, rule in rules.items():
            timings = [execution.Timing(path, t, rows) for rows, q, p in measured[shape][1]
                       for path, t in (("plain", q), ("packed", p))] if shape in measured else []
            err = errors.get(shape.dtype)
            # A pin explains itself (ExecutionPlan.record); a mode given here by argument is said.
            why = err or ("" if mode == "auto" or pinned != execution.AUTO else f"linear path {mode}")
            if shape in kept:
                why = f"packed copy widened to float32 (faster at {'/'.join(map(str, COPY_ROWS))} rows)"
            elif rule.ever_packed and packs.get(shape.dtype) not in (None, shape.dtype):
                why = f"packed copy widened to float32 (oneDNN packs no {str(shape.dtype)[6:]} here)"
            record.record(f"linear {shape}", str(rule), timings, why)
    else:   # without an execution plan to log each shape's choice, one line for all of them
        log.info("linear path %s [%.0f ms]", result.summary, (time.perf_counter() - start) * 1e3)
    if details:
        log.debug("linear path timings, rows:plain_us/packed_us: %s", "  ".join(details))
    return result


class Projection:
    """A frozen weight [out, in] (+ bias [out]) whose call picks its path by row count."""

    __slots__ = ("weight", "bias", "packed", "rule", "split")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, chosen: Plan):
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.rule = chosen.rule(self.weight, self.bias)
        self.packed = chosen.pack(self.weight, self.bias) if self.rule.ever_packed else None
        self.split = None   # a split_products.Split where the caller chose one (--matmul-precision high)

    def __call__(self, x: torch.Tensor, gelu: str | None = None, residual: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """x [N, in] -> [N, out]; gelu (F.gelu's `approximate`) and residual [N, out] as packed_linear's."""
        if self.split is not None and self.split.takes(x.shape[0]):
            y = self.split(x, self.bias)
        elif self.packed is not None and self.rule.use_packed(x.shape[0]):
            return packed_linear(x, self.packed, self.bias, gelu, residual)
        else:
            y = F.linear(x, self.weight, self.bias)
        y = y if gelu is None else F.gelu(y, approximate=gelu)
        return y if residual is None else y + residual
