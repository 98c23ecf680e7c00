"""Greedy tokens through a bf16 screen of an fp32 LM head: the argmax of the fp32 logits, from half the bytes.

Why: a greedy row needs only the argmax of its logits, but the head is the largest weight a step reads.
SmolLM2-135M's tied fp32 head is 113 MB of the 538 MB a batch-1 step streams from memory, and 3.6 of the
17 GFLOP of a 64-row step. Its bf16 copy is half of either.

How, for sampled rows h [M, H] (fp32) and the head W [V, H] (fp32, no bias), L = h @ W^T the fp32
logits the full head computes (in any order of summation):
  1. scores s = h @ Wb^T with Wb = bf16(W), fp32 sums: the few-row kernel (gemv_cpu) over fp32 h up to the
     rows chosen at load (choose_scores: at most gemv_cpu.MAX_ROWS), the panel kernel (tile_gemm_cpu) over
     bf16(h) above, else F.linear.
  2. |s[r, i] - L[r, i]| <= radius[r] * norms[i], with norms[i] = ||W_i||_2 and radius[r] = C ||h_r||_2:
     per term, |h_k W_ik - h'_k Wb_ik| <= e |h_k W_ik| with e = u (h kept fp32) or 2u + u^2 (h rounded
     to bf16), u = 2^-8 the bf16 unit roundoff; each fp32 sum of K terms errs by at most
     gamma_K = K 2^-24 / (1 - K 2^-24) of sum |terms|, whatever its order; Cauchy-Schwarz bounds
     sum_k |h_k W_ik| by ||h|| ||W_i||. C = 1.25 (e + 2 gamma_(K+1) (1 + u)^2): the quarter of margin
     covers the fp32 rounding of the radius, the norms and the bound sums (each under 2^-22 ||h|| ||W_i||).
  3. The argmax i* of L has s[i*] + radius n[i*] >= L[i*] >= L[j] >= s[j] - radius n[j] for every j, so
     it is among the candidates screen_cpu.candidates returns. Their fp32 logits are computed from W's
     rows (F.linear over the gathered rows) and the largest wins, the first in vocabulary order on a tie,
     as torch's max over the full row does.
The token equals the full head's argmax except where two fp32 logits lie within the rounding of their
summation order of each other, where the head's own matmul paths (chosen per machine) may differ too.
Rows that are not finite are left to the full head (the screen returns None).
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from services.common import arena, native
from services.common import plan as execution
from services.decoder.kernels import gemv_cpu, screen_cpu, tile_gemm_cpu

log = logging.getLogger("tessera.decoder.screen")

BF16_UNIT = 2.0 ** -8
TIMING_ROWS = (1, 4, 16, 64)


def error_scale(k: int, rounded_rows: bool, rounded_scores: bool = False) -> float:
    """C of the module docstring for dot products of length k; rounded_rows: h is rounded to bf16 too;
    rounded_scores: the scores are rounded to bf16 as well (|s| <= (1 + e) ||h|| ||W_i||)."""
    u = BF16_UNIT
    gamma = (k + 1) * 2.0 ** -24 / (1 - (k + 1) * 2.0 ** -24)
    e = (2 * u + u * u if rounded_rows else u) + 2 * gamma * (1 + u) ** 2
    if rounded_scores:
        e += u * (1 + e)
    return 1.25 * e


class ArgmaxScreen:
    """The bf16 copy of an fp32 head [V, H], its row norms [V], and the rows it runs for (`max_rows`)."""

    def __init__(self, weight: torch.Tensor, huge_pages: bool = True):
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("the argmax screen is for an fp32 head on CPU")
        self.weight = weight
        low = weight.to(torch.bfloat16)
        # Rounded up, so that a norm never understates its row.
        norms = torch.nextafter(weight.double().norm(dim=1).float(), torch.tensor(math.inf))
        # Both layouts of the copy, in 2 MiB pages like the weights: the few-row kernel reads the rows,
        # the panel kernel the 64-column panels.
        tensors = [low, norms] + ([tile_gemm_cpu.pack(low)] if _tiles(low) else [])
        self.arena, placed, _ = arena.place(tensors, huge_pages)
        self.low, self.norms = placed[:2]
        self.panels = placed[2] if len(placed) > 2 else None
        k = weight.shape[1]
        self.scale_exact, self.scale_rounded = error_scale(k, False), error_scale(k, True)
        self.scale_library = error_scale(k, True, rounded_scores=True)
        self.few_rows = _gemv()       # whether the few-row kernel is here to score up to MAX_ROWS rows
        # The rows up to which the few-row kernel scores (choose_scores); above, the panels where they exist.
        self.kernel_rows = gemv_cpu.MAX_ROWS if self.few_rows else 0
        self.max_rows = 0

    def scores(self, h: torch.Tensor) -> tuple[torch.Tensor, float]:
        """h [M, H] fp32 -> (fp32 scores [M, V] of the bf16 head, C for them)."""
        if h.shape[0] <= self.kernel_rows:
            return gemv_cpu.gemv(h, self.low), self.scale_exact
        if self.panels is not None:
            return tile_gemm_cpu.tile_gemm(h.to(torch.bfloat16), self.panels), self.scale_rounded
        # The library's bf16 matmul sums in fp32 but returns bf16: one more rounding of each score.
        return F.linear(h.to(torch.bfloat16), self.low).float(), self.scale_library

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """h [M, H] fp32 -> int64 [M], the argmax of h @ W^T per row; None when a row is not finite."""
        if not bool(torch.isfinite(h).all()):
            return None
        s, scale = self.scores(h)
        radius = (h.double().norm(dim=1) * scale).float()
        radius = torch.nextafter(radius, torch.tensor(math.inf))
        pairs = screen_cpu.candidates(s, radius, self.norms)
        union, column = torch.unique(pairs[:, 1], return_inverse=True)
        exact = torch.full((h.shape[0], union.numel()), -math.inf)
        exact[pairs[:, 0], column] = F.linear(h, self.weight.index_select(0, union))[pairs[:, 0], column]
        return union[exact.max(dim=1).indices]


def _gemv() -> bool:
    try:
        gemv_cpu.load()
        return True
    except native.BuildError:
        return False


def _tiles(low: torch.Tensor) -> bool:
    return tile_gemm_cpu.available(torch.bfloat16) and tile_gemm_cpu.fits(low)


def build(head: torch.nn.Module, head_fn, hidden_norm: float, record: execution.ExecutionPlan,
          huge_pages: bool = True, refused: str = "") -> tuple[ArgmaxScreen | None, str]:
    """(the screen or None, a one-line summary) for the `screen` path of record. head_fn(h) -> fp32 logits
    is the full head it replaces for greedy rows; hidden_norm, the typical norm of a final hidden state
    (for timing); refused: why the model's logits are not the head's own (a family's, CausalLM.unsupported),
    or "". Pinned on, the screen serves every row count of a head it applies to (a bf16, int8 or
    biased head, or a refused one, keeps the full head, said at WARNING and in the record: one pin can serve
    a fleet of models); auto keeps it for the row counts up to where it beat head_fn (plan.beats) at every
    timed count. Pinned on where the screen's operator cannot be built: native.BuildError."""
    want = record.pinned("screen")
    weight = head.weight
    if want == "off":
        record.record("screen", "off")
        return None, "off (--fast-paths screen=off)"
    if refused:
        pinned = want == "on"
        record.record("screen", "off", level=logging.WARNING if pinned else logging.INFO,
                      reason=refused + (" (pinned on: not applicable to this model)" if pinned else ""))
        return None, f"off ({refused})"
    quantized = getattr(head, "qweight", None) is not None or getattr(head, "grouped", None) is not None
    if quantized or weight.dtype != torch.float32 or weight.device.type != "cpu" or head.bias is not None:
        pinned = want == "on"
        record.record("screen", "off", reason="only for an fp32 head without bias on CPU" +
                      (" (pinned on: not applicable to this model)" if pinned else ""),
                      level=logging.WARNING if pinned else logging.INFO)
        return None, "off (only for an fp32 head without bias on CPU)"
    try:
        screen_cpu.load()
    except native.BuildError as e:
        if want == "on":
            raise
        log.warning("argmax screen unavailable, greedy rows use the full head: %s", e)
        record.record("screen", "off", reason=f"unavailable: {str(e).splitlines()[0]}")
        return None, f"off (unavailable: {str(e).splitlines()[0]})"
    screen = ArgmaxScreen(weight, huge_pages)
    choose_scores(screen, record, hidden_norm)
    if want == "on":
        screen.max_rows = 1 << 30
        record.record("screen", "on")
        return screen, "bf16, every row count (--fast-paths screen=on)"
    timings, timed = [], []
    for rows in TIMING_ROWS:
        took = time_rows(screen, head_fn, rows, hidden_norm)
        timings += [execution.Timing(p, t, rows) for p, t in took.items()]
        timed.append(f"{rows} row{'s' * (rows > 1)} {1e3 * took['off']:.2f} vs {1e3 * took['on']:.2f} ms")
        if execution.pick(took, "off") != "on":
            break
        screen.max_rows = rows
    summary = "; ".join(timed)
    record.record("screen", f"on rows<={screen.max_rows}" if screen.max_rows else "off", timings)
    if not screen.max_rows:
        return None, f"off (timed full head vs screen: {summary})"
    return screen, f"bf16 rows<={screen.max_rows} (timed full head vs screen: {summary})"


@torch.inference_mode()
def choose_scores(screen: ArgmaxScreen, record: execution.ExecutionPlan, hidden_norm: float) -> None:
    """Set screen.kernel_rows as the path `screen_scores` of record says, and record it: pinned `kernel`, the few-row
    kernel scores every count it runs (MAX_ROWS); pinned `panels`, none; auto, timed at 1..MAX_ROWS rows (plan.pick,
    the kernel the default), it keeps the counts below the first where the panels won. Why: on a Zen 4 (family 25
    model 17, 2 threads) SmolLM2's head scored 2-5 rows in 1.6 ms by the panels and 1.8-4.1 ms by the kernel,
    which reads the weights once but loads a row of x per product. Where only one of the two is built, it scores."""
    want = record.pinned("screen_scores")
    if not screen.few_rows or screen.panels is None:
        only = "kernel" if screen.few_rows else "panels" if screen.panels is not None else "library"
        record.record("screen_scores", only, reason="the only scorer this CPU runs" +
                      (f" (pinned {want}: not available here)" if want not in (execution.AUTO, only) else ""))
        return
    if want != execution.AUTO:
        screen.kernel_rows = gemv_cpu.MAX_ROWS if want == "kernel" else 0
        record.record("screen_scores", want)
        return
    timings, screen.kernel_rows = [], 0
    for rows in range(1, gemv_cpu.MAX_ROWS + 1):
        took = time_scores(screen, rows, hidden_norm)
        timings += [execution.Timing(p, t, rows) for p, t in took.items()]
        if execution.pick(took, "kernel") != "kernel":
            break
        screen.kernel_rows = rows
    record.record("screen_scores", f"kernel rows<={screen.kernel_rows}" if screen.kernel_rows else "panels", timings)


def timing_rows(weight: torch.Tensor, rows: int, hidden_norm: float) -> torch.Tensor:
    """[rows, H] hidden states that each predict one token clearly (a head row scaled to hidden_norm), as a trained
    model's rows do; random rows would give flat logits and far more candidates than real decoding."""
    picks = torch.randint(0, weight.shape[0], (rows,), generator=torch.Generator().manual_seed(rows))
    h = weight.index_select(0, picks)
    return (h * (hidden_norm / h.norm(dim=1, keepdim=True))).contiguous()


@torch.inference_mode()
def time_scores(screen: ArgmaxScreen, rows: int, hidden_norm: float) -> dict[str, float]:
    """{"kernel": the few-row kernel's scores s, "panels": the panel kernel's s} at `rows` rows of timing_rows."""
    h = timing_rows(screen.weight, rows, hidden_norm)
    return execution.fastest({"kernel": lambda: gemv_cpu.gemv(h, screen.low),
                              "panels": lambda: tile_gemm_cpu.tile_gemm(h.to(torch.bfloat16), screen.panels)})


@torch.inference_mode()
def time_rows(screen: ArgmaxScreen, head_fn, rows: int, hidden_norm: float) -> dict[str, float]:
    """{"off": full head + argmax s, "on": screen s} at `rows` rows of timing_rows (plan.fastest)."""
    h = timing_rows(screen.weight, rows, hidden_norm)
    return execution.fastest({"off": lambda: head_fn(h).max(dim=1), "on": lambda: screen.argmax(h)})
