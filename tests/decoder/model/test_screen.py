"""The greedy argmax screen (model/screen.py): its error bound on every scoring path, its argmax against
the full fp32 head on near-ties that bf16 alone gets wrong, and when it is built or refused."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from services.common.plan import ExecutionPlan
from services.decoder.kernels import gemv_cpu, tile_gemm_cpu
from services.decoder.model import screen as screen_mod
from services.decoder.model.linear import Linear
from services.decoder.model.screen import ArgmaxScreen, build, choose_scores

pytestmark = pytest.mark.numerics

V, H = 3008, 576        # V: whole 64-column panels, so the panel kernel runs where the CPU has it


def head_weight(seed: int = 0) -> torch.Tensor:
    """Rows of norms 0.1 to 10 (the bound is per row), and 600 pairs of rows 1e-3 apart (near-ties)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g) * torch.logspace(-1, 1, V)[torch.randperm(V, generator=g)][:, None] / 24
    base = w[0::5][:600]
    w[1::5][:600] = base + 1e-3 * torch.randn(600, H, generator=g) * base.norm(dim=1, keepdim=True) / 24
    return w.contiguous()


def hidden_rows(w: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Half random rows (flat logits), half pointing at one of a near-tied pair (the top two logits
    then differ by about the pair's difference), at a final hidden state's norm (~48)."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(n - n // 2, H, generator=g)
    tied = w[0::5][torch.randint(0, 600, (n // 2,), generator=g)] + 0.05 * torch.randn(n // 2, H, generator=g) / 24
    h = torch.cat([flat, tied])
    return (h / h.norm(dim=1, keepdim=True) * 48).contiguous()


def paths(screen: ArgmaxScreen, monkeypatch):
    """(name, rows, setup) for the ways scores are computed (the panels at few rows: screen_scores=panels)."""
    def library():
        monkeypatch.setattr(screen, "panels", None)
    return [("few-row kernel, fp32 rows", 3, lambda: None), ("panel kernel, bf16 rows", 24, lambda: None),
            ("panel kernel at few rows", 3, lambda: monkeypatch.setattr(screen, "kernel_rows", 0)),
            ("library matmul, bf16 rows and scores", 24, library)]


def test_scores_stay_within_the_bound_on_every_path(monkeypatch):
    w = head_weight()
    screen = ArgmaxScreen(w)
    assert (screen.panels is not None) == tile_gemm_cpu.available(torch.bfloat16)
    for name, rows, setup in paths(screen, monkeypatch):
        setup()
        h = hidden_rows(w, rows, seed=rows)
        scores, scale = screen.scores(h)
        bound = (h.double().norm(dim=1) * scale)[:, None] * screen.norms.double()[None, :]
        for truth in (F.linear(h, w).double(), F.linear(h.double(), w.double())):    # fp32 in any order, exact
            used = ((scores.double() - truth).abs() / bound).max().item()
            # Not vacuous: the bf16 error is a sizeable part of the bound (it is a worst case).
            assert 0.02 < used < 1, f"{name}: {used:.3f} of the bound"


def test_argmax_equals_the_fp32_head_where_bf16_alone_does_not(monkeypatch):
    w = head_weight(1)
    screen = ArgmaxScreen(w)
    low = w.bfloat16().float()
    wrong_bf16 = 0
    for name, rows, setup in paths(screen, monkeypatch):
        setup()
        for seed in range(4):
            h = hidden_rows(w, rows, seed=100 * seed + rows)
            full = F.linear(h, w).max(dim=1).indices
            assert torch.equal(screen.argmax(h), full), name
            wrong_bf16 += int((F.linear(h, low).max(dim=1).indices != full).sum())
    assert wrong_bf16 > 0          # the near-ties are real: bf16 scores alone pick other tokens


def test_ties_go_to_the_first_index_like_the_full_head():
    w = head_weight(2)
    top = int(w.norm(dim=1).argmax())            # pointing at the longest row makes it the maximum
    twin = top + 1 if top + 1 < V else top - 1
    w[twin] = w[top]
    screen = ArgmaxScreen(w.contiguous())
    h = (w[top:top + 1] / w[top].norm() * 48).contiguous()
    first = min(top, twin)
    assert F.linear(h, w).max(dim=1).indices.item() == first
    assert screen.argmax(h).tolist() == [first]


def test_rows_that_are_not_finite_go_to_the_full_head():
    w = head_weight(3)
    h = hidden_rows(w, 2, seed=0)
    h[1, 5] = math.nan
    assert ArgmaxScreen(w).argmax(h) is None


def linear(weight: torch.Tensor, bias: bool = False) -> Linear:
    m = Linear(weight.shape[1], weight.shape[0], bias=bias)
    m.weight.data = weight
    return m


def test_built_only_for_an_fp32_head_without_bias():
    w = head_weight(4)
    on = ExecutionPlan("screen=on")
    # Pinned on for a model it does not apply to: the full head, said in the record (and at WARNING).
    assert build(linear(w.bfloat16()), None, 48.0, on)[0] is None and on.chosen("screen") == "off"
    assert on.get("screen").reason.endswith("(pinned on: not applicable to this model)")
    auto = ExecutionPlan()
    assert build(linear(w.bfloat16()), None, 48.0, auto) == (None, "off (only for an fp32 head without bias on CPU)")
    assert auto.chosen("screen") == "off"
    assert build(linear(w, bias=True), None, 48.0, auto)[0] is None
    quantized = linear(w)
    quantized.quantize(release=False)
    assert build(quantized, None, 48.0, auto)[0] is None
    off = ExecutionPlan("screen=off")
    assert build(linear(w), None, 48.0, off) == (None, "off (--fast-paths screen=off)")
    assert off.get("screen").reason == "pinned by --fast-paths screen=off"
    screen, _ = build(linear(w), None, 48.0, on)
    assert screen.max_rows == 1 << 30 and on.chosen("screen") == "on"


def test_auto_keeps_the_row_counts_up_to_where_the_timing_says_it_won(monkeypatch):
    """The choice comes from measurement: fake timings decide, and the summary reports them."""
    times = {1: (2.0, 1.0), 4: (3.0, 2.0), 16: (4.0, 3.9), 64: (9.0, 4.0)}    # 16 rows: within the tie
    monkeypatch.setattr(screen_mod, "time_rows", lambda screen, fn, rows, norm: {"off": 1e-3 * times[rows][0],
                                                                                 "on": 1e-3 * times[rows][1]})
    record = ExecutionPlan()
    screen, summary = build(linear(head_weight(5)), None, 48.0, record)
    assert screen.max_rows == 4
    assert summary == ("bf16 rows<=4 (timed full head vs screen: 1 row 2.00 vs 1.00 ms; 4 rows 3.00 vs 2.00 ms; "
                       "16 rows 4.00 vs 3.90 ms)")
    assert record.chosen("screen") == "on rows<=4" and len(record.get("screen").timings) == 6
    times[1] = (1.0, 1.0)
    assert build(linear(head_weight(5)), None, 48.0, record)[0] is None and record.chosen("screen") == "off"


def test_real_timing_runs_and_reports_both_sides():
    head = linear(head_weight(6))
    screen = ArgmaxScreen(head.weight)
    took = screen_mod.time_rows(screen, lambda h: head(h).float(), 4, 48.0)
    assert took["off"] > 0 and took["on"] > 0
    if screen.panels is not None:
        took = screen_mod.time_scores(screen, 4, 48.0)
        assert took["kernel"] > 0 and took["panels"] > 0


def test_the_scorer_runs_the_row_counts_its_choice_gave(monkeypatch):
    screen = ArgmaxScreen(head_weight(7))
    h = hidden_rows(screen.weight, 3, seed=7)
    assert screen.kernel_rows == gemv_cpu.MAX_ROWS and screen.scores(h)[1] == screen.scale_exact
    monkeypatch.setattr(screen, "kernel_rows", 2)      # 3 rows: above the kernel's, bf16 rows
    above = screen.scale_rounded if screen.panels is not None else screen.scale_library
    assert screen.scores(h)[1] == above and screen.scores(h[:2])[1] == screen.scale_exact


def test_the_scorer_follows_its_pin_or_the_timings(monkeypatch):
    """screen_scores: pinned, no timing; auto, the kernel up to the count before the first where the panels
    beat it by the plan's margin. A CPU without the panels keeps the kernel, whatever the pin."""
    w = head_weight(8)
    times = {1: (1.0, 2.0), 2: (1.0, 1.5), 3: (1.0, 0.97), 4: (2.0, 1.0)}    # 3 rows: within the tie
    monkeypatch.setattr(screen_mod, "time_scores", lambda screen, rows, norm: {"kernel": 1e-3 * times[rows][0],
                                                                               "panels": 1e-3 * times[rows][1]})
    for pins, rows, chosen in (("screen_scores=kernel", gemv_cpu.MAX_ROWS, "kernel"),
                               ("screen_scores=panels", 0, "panels"), ("", 3, "kernel rows<=3")):
        record, screen = ExecutionPlan(pins), ArgmaxScreen(w)
        choose_scores(screen, record, 48.0)
        if screen.panels is None:
            assert screen.kernel_rows == gemv_cpu.MAX_ROWS and record.chosen("screen_scores") == "kernel"
            continue
        assert (screen.kernel_rows, record.chosen("screen_scores")) == (rows, chosen)
        assert len(record.get("screen_scores").timings) == (8 if not pins else 0)
    times[1] = (2.0, 1.0)
    record, screen = ExecutionPlan(), ArgmaxScreen(w)
    choose_scores(screen, record, 48.0)
    assert screen.kernel_rows == (0 if screen.panels is not None else gemv_cpu.MAX_ROWS)
