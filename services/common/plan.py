"""The machine's execution plan: which of its candidate paths each fast path runs, chosen once at load.

Several computations have more than one implementation that computes the same function (the matmul
path per weight shape, the few-row kernel, the glue ops, decode attention, the decode stack, the
argmax screen, the grammar mask, the encoder attention), and which is faster depends on the CPU, the
dtype and the shapes. Each path module declares its candidates and a way to time them; this module
owns everything else, so that every choice is made and reported the same way:

- one timer (`fastest`): each candidate called once to warm up, then REPS interleaved rounds (every
  candidate once per round, so all see the same clocks and caches); other processes only ever add
  time, hence
- one statistic: the minimum over the rounds;
- one tie rule (`beats`): a challenger replaces the path kept by default only when it is faster by
  more than TIE; the default is the older path, so noise between two equal paths changes nothing;
- one log line per choice (`ExecutionPlan.record`), and one structured record of all of them
  (`ExecutionPlan.choices`), which GetModelInfo returns;
- one override: `--fast-paths name=value,...` (`Pins`), where value is one of the path's candidates
  or `auto` (timed, the default). Tests pin paths the same way, so what a test runs does not depend on
  the machine's timing.

This module imports no torch: the service configs parse `--fast-paths` with it.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger("tessera.plan")

AUTO = "auto"
# A challenger must be this much faster than the default path to replace it.
TIE = 0.05
# Interleaved rounds per measurement, after one warm-up call of each candidate.
REPS = 5

# Every fast path that can be pinned: name -> its candidates (the first is the default kept on a tie).
# "auto" is accepted for each as well.
PATHS: dict[str, tuple[str, ...]] = {
    # decoder and pooling: oneDNN-packed or plain F.linear per weight shape (services/common/linear_path.py)
    "linear": ("plain", "packed"),
    # decoder and pooling: under --matmul-precision high, fp32 matmuls from some row count on the tile unit with each
    # product split in bf16 halves, per weight shape (services/common/split_products.py)
    "split_products": ("off", "on"),
    # decoder: the few-row kernel at 1..4 rows (services/decoder/model/matmul_choice.py)
    "gemv": ("off", "on"),
    # decoder: the matmul over int8 weights above the few-row kernel's rows, per weight shape
    # (services/decoder/model/quantization.py GEMMS, chosen in services/decoder/model/matmul_choice.py)
    "int8_gemm": ("int8pack", "dequant", "dynamic", "tiles", "amx"),
    # decoder: the few-row kernel's loop for bf16 x over bf16 weights (services/decoder/model/matmul_choice.py)
    "gemv_bf16_row": ("rowwise", "interleave4"),
    # decoder: whether the few-row kernels ask for the weights ahead of the row they read
    # (services/decoder/model/matmul_choice.py)
    "gemv_prefetch": ("off", "on"),
    # decoder: the order the few-row kernels read each thread's weight rows in: front to back, or from the two halves
    # of its share in turn (services/decoder/model/matmul_choice.py)
    "gemv_streams": ("one", "two"),
    # decoder: the few-row kernel's order of work over grouped 4/8-bit weights (services/decoder/model/matmul_choice.py)
    "gemv_grouped_loop": ("chunks", "pairs"),
    # decoder: many rows over grouped 4/8-bit weights: dequantized for the library matmul, torch's 4-bit kernel,
    # or widened block by block in cache and multiplied by AVX-512 dot products (tiles) or on the tile unit (amx)
    # (services/decoder/model/matmul_choice.py, choose_grouped_matmul)
    "grouped_matmul": ("dequant", "int4pack", "tiles", "amx"),
    # decoder: RMSNorm and SiLU(gate) * up by torch's ops or the C++ row ops (services/decoder/model/glue.py)
    "glue": ("torch", "cpp"),
    # decoder: decode attention (services/decoder/runner/attention.py)
    "attention": ("cpp", "torch"),
    # decoder: every layer of a few-row decode step in one C++ call (services/decoder/runner/fused_decode.py)
    "decode_stack": ("off", "on"),
    # decoder: the decode stack's dense projections on the panel kernel, from a second copy of the layers' weights
    # in 64-column panels; timed against the stack without them where the copy fits in half the memory available
    # (services/decoder/runner/fused_decode.py)
    "decode_panels": ("off", "on"),
    # decoder: the CPU adapter rows' least work per thread, coarse (a few rows' corrections on one thread) or fine
    # (split over the threads) (services/decoder/lora/pool.py, kernels/lora_cpu.py GRAINS); timed with adapters
    "lora_split": ("coarse", "fine"),
    # decoder: how the CPU adapter rows' blocks ask for the rows they read next: a few lines at every step of the
    # phase before, all at once, or not (kernels/lora_rows.h Ahead, services/decoder/lora/pool.py); timed with
    # adapters, at the chosen lora_split
    "lora_prefetch": ("paced", "burst", "off"),
    # decoder: greedy rows through a bf16 screen of an fp32 head (services/decoder/model/screen.py)
    "screen": ("off", "on"),
    # decoder: how the screen scores rows against its bf16 head: the few-row kernel over fp32 rows up to its rows, or
    # the panel kernel over bf16 rows (services/decoder/model/screen.py)
    "screen_scores": ("kernel", "panels"),
    # decoder: how grammar masks are applied to the logits (services/decoder/grammar/mask.py)
    "grammar_mask": ("unpacked", "xgrammar"),
    # decoder: weights and KV cache in 2 MiB pages (services/common/arena.py); not timed
    "huge_pages": ("on", "off"),
    # decoder and pooling: glibc keeps freed pages for the next forward (services/common/allocator.py); not timed
    "malloc": ("keep", "default"),
    # decoder: n-gram drafts gated per request on the measured cost of verifying them, or drafted wherever an
    # n-gram repeats (services/decoder/runner/verify_cost.py); timed only with --speculative-config
    "speculation": ("adaptive", "always"),
    # pooling: encoder attention by the C++ operator or grouped SDPA (services/pooling/packed.py)
    "encoder_attention": ("torch", "cpp"),
}

# The paths each service runs.
DECODER = ("linear", "split_products", "gemv", "int8_gemm", "gemv_bf16_row", "gemv_prefetch", "gemv_streams",
           "gemv_grouped_loop", "grouped_matmul", "glue", "attention", "decode_stack", "decode_panels", "screen",
           "screen_scores", "grammar_mask", "huge_pages", "malloc", "speculation", "lora_split", "lora_prefetch")
POOLING = ("linear", "split_products", "encoder_attention", "malloc")


def help_for(paths: tuple[str, ...]) -> str:
    """The --fast-paths help of a service that runs `paths`."""
    example = ",".join(f"{name}={PATHS[name][0]}" for name in paths[:2])
    return (f"pin fast paths instead of timing them at load, e.g. '{example}'; each is auto (timed, the default) "
            "or one of: " + "; ".join(f"{name} {'|'.join(PATHS[name])}" for name in paths))


@dataclass(frozen=True)
class Pins:
    """What `--fast-paths` pinned: path name -> candidate; paths it does not name are auto."""

    values: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | Pins | Mapping[str, str] | None, paths: tuple[str, ...] = tuple(PATHS)) -> Pins:
        """'linear=plain, screen=off' (or a mapping) -> Pins; ValueError in one line names what is wrong.
        paths: the ones this service runs."""
        if isinstance(text, Pins):
            return text
        if text is None:
            return cls({})
        items = text.items() if isinstance(text, Mapping) else \
            [part.partition("=")[::2] for part in text.split(",") if part.strip()]
        values: dict[str, str] = {}
        for name, value in items:
            name, value = name.strip().lower(), value.strip().lower()
            if name not in paths:
                raise ValueError(f"--fast-paths: unknown path {name!r}; choose from {', '.join(paths)}")
            if value != AUTO and value not in PATHS[name]:
                raise ValueError(f"--fast-paths {name}={value!r}: expected auto or one of {', '.join(PATHS[name])}")
            if name in values:
                raise ValueError(f"--fast-paths names {name} twice")
            if value != AUTO:
                values[name] = value
        return cls(values)

    def get(self, name: str) -> str:
        """The pinned candidate of path `name`, or "auto"."""
        if name not in PATHS:
            raise KeyError(f"no fast path {name!r}")
        return self.values.get(name, AUTO)

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.values.items())


@dataclass(frozen=True)
class Timing:
    """One measurement: a candidate's seconds per call, at `rows` rows (0 where rows do not apply)."""

    candidate: str
    seconds: float
    rows: int = 0


@dataclass(frozen=True)
class Choice:
    """What one fast path runs: `chosen` (a candidate, or a per-row-count rule such as "on rows<=4"),
    the timings it was chosen from (none when pinned or not eligible), and why in words."""

    name: str
    chosen: str
    timings: tuple[Timing, ...] = ()
    reason: str = ""

    def line(self) -> str:
        """The log line: "screen: on rows<=16 (timed) [1 row: off 0.41 ms, on 0.20 ms; ...]"."""
        text = f"{self.name}: {self.chosen}" + (f" ({self.reason})" if self.reason else "")
        if self.timings:
            by_rows: dict[int, list[str]] = {}
            for t in self.timings:
                by_rows.setdefault(t.rows, []).append(f"{t.candidate} {t.seconds * 1e3:.3f} ms")
            text += " [" + "; ".join((f"{r} row{'s' * (r > 1)}: " if r else "") + ", ".join(parts)
                                     for r, parts in by_rows.items()) + "]"
        return text


def fastest(calls: Mapping[str, Callable[[], object]], reps: int = REPS, sync: Callable[[], object] | None = None,
            warm: bool = True, budget_s: float | None = None) -> dict[str, float]:
    """{candidate: call} -> {candidate: seconds}, the minimum over `reps` interleaved rounds, after one
    warm-up call of each (warm=False: the caller has warmed them). budget_s: stop after the round that
    passes it (at least one round), for callers that time many shapes. sync (e.g. torch.cuda.synchronize)
    runs before and after every timed call."""
    if warm:
        for call in calls.values():
            call()
    best = dict.fromkeys(calls, math.inf)
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    for _ in range(reps):
        for name, call in calls.items():
            if sync is not None:
                sync()
            start = time.perf_counter()
            call()
            if sync is not None:
                sync()
            best[name] = min(best[name], time.perf_counter() - start)
        if deadline is not None and time.perf_counter() >= deadline:
            break
    return best


def beats(challenger: float, default: float) -> bool:
    """The tie rule: True when a challenger's time is below the default path's by more than TIE."""
    return challenger * (1 + TIE) < default


def tied(a: float, b: float) -> bool:
    """Neither of two times beats the other (see beats)."""
    return not beats(a, b) and not beats(b, a)


def pick(seconds: Mapping[str, float], default: str) -> str:
    """The candidate to run: the fastest, if it beats `default` (see beats); else default."""
    best = min(seconds, key=seconds.get)
    return best if best != default and beats(seconds[best], seconds[default]) else default


def path_of(choice_name: str) -> str:
    """The pinnable path a choice belongs to: "linear 576x576" -> "linear", "glue.norm" -> "glue"."""
    return choice_name.split(" ", 1)[0].split(".", 1)[0]


class ExecutionPlan:
    """The pins a process was started with and the choices made under them, in the order made."""

    def __init__(self, pins: Pins | str | Mapping[str, str] | None = None, paths: tuple[str, ...] = tuple(PATHS)):
        """paths: the ones the service runs (DECODER, POOLING); a pin of any other is refused."""
        self.pins = Pins.parse(pins, paths)
        self.choices: list[Choice] = []

    def pinned(self, name: str) -> str:
        """The candidate path `name` is pinned to, or "auto"."""
        return self.pins.get(name)

    def record(self, name: str, chosen: str, timings: tuple[Timing, ...] | list[Timing] = (),
               reason: str = "", level: int = logging.INFO) -> Choice:
        """Add a choice (replacing an earlier one of the same name) and log its one line."""
        path = path_of(name)
        if not reason and path in PATHS and self.pinned(path) != AUTO:
            reason = f"pinned by --fast-paths {path}={self.pinned(path)}"
        choice = Choice(name, chosen, tuple(timings), reason)
        self.choices = [c for c in self.choices if c.name != name] + [choice]
        log.log(level, "fast path %s", choice.line())
        return choice

    def get(self, name: str) -> Choice | None:
        return next((c for c in self.choices if c.name == name), None)

    def chosen(self, name: str) -> str:
        """The chosen value of the choice `name`; KeyError when none was made."""
        choice = self.get(name)
        if choice is None:
            raise KeyError(f"no choice {name!r} in this plan")
        return choice.chosen

    def summary(self) -> str:
        """All choices in one line (benchmarks print it): "linear 576x576: packed; attention: cpp; ..."."""
        return "; ".join(f"{c.name}: {c.chosen}" for c in self.choices)

    def to_proto(self):
        """This plan as tessera.common.v1.ExecutionPlan (GetModelInfo of the decoder and pooling)."""
        from services.common.pb import common_pb2  # generated code; the configs import this module without it
        return common_pb2.ExecutionPlan(pins=str(self.pins), choices=[
            common_pb2.FastPathChoice(name=c.name, chosen=c.chosen, reason=c.reason, timings=[
                common_pb2.FastPathTiming(candidate=t.candidate, seconds=t.seconds, rows=t.rows) for t in c.timings])
            for c in self.choices])
