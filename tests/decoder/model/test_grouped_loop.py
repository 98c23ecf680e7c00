"""The few-row kernel's loop over grouped weights per machine (model/matmul_choice.py, choose_grouped_loop): chosen
from the plan's timer at the model's grouped weights, pinned by --fast-paths gemv_grouped_loop, recorded with why,
and run by each Linear and by the decode stack's projections."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from services.common import plan as execution
from services.common.plan import ExecutionPlan
from services.decoder.kernels import gemv_cpu, gemv_grouped_cpu
from services.decoder.model import grouped
from services.decoder.model.linear import Linear
from services.decoder.model.matmul_choice import choose_grouped_loop


def grouped_model() -> nn.Sequential:
    """Two int4 weights and one dense fp32 weight."""
    model = nn.Sequential(Linear(64, 96), Linear(96, 32, bias=False), Linear(32, 48))
    for m in model[:2]:
        m.set_grouped(grouped.quantize(m.weight, 4, 32))
    return model


def timer_of(ms: dict[int, tuple[float, float]], calls: list):
    """A timer: ms[rows] = (chunks, pairs) milliseconds per pass."""
    def timer(group, rows):
        calls.append((len(group), rows))
        return {loop: ms[rows][i] * 1e-3 for i, loop in enumerate(gemv_grouped_cpu.WIDEST)}
    return timer


FASTER = {r: (9.0, 6.0) for r in range(1, 5)}


@pytest.mark.parametrize("ms,expected", [
    (FASTER, "pairs"),                                           # faster at every row count
    ({**FASTER, 1: (6.0, 9.0)}, "chunks"),                       # slower at one row
    ({**FASTER, 3: (5.0, 9.0)}, "chunks"),                       # beaten at three rows
    ({r: (6.2, 6.0) for r in range(1, 5)}, "chunks"),            # within the tie rule: the default stays
])
def test_the_loop_follows_the_timings(ms, expected, monkeypatch):
    monkeypatch.setattr(gemv_grouped_cpu, "vnni", lambda: True)
    model, record, calls = grouped_model(), ExecutionPlan(), []
    summary = choose_grouped_loop(model, record, timer_of(ms, calls))
    assert [m.grouped_loop for m in model[:2]] == [expected, expected]
    choice = record.get("gemv_grouped_loop")
    assert choice.chosen == expected and choice.reason == "timed over 2 grouped weights"
    assert summary == f"gemv grouped loop: {expected} (timed over 2 grouped weights)"
    # Every row count of the kernel's first pass, over every grouped weight, whatever rows choose_gemv gives them later.
    assert calls == [(2, r) for r in range(1, gemv_cpu.PASS_ROWS + 1)]
    assert [(t.rows, t.candidate) for t in choice.timings] == [
        (r, loop) for r in range(1, 5) for loop in gemv_grouped_cpu.WIDEST]


@pytest.mark.parametrize("loop", gemv_grouped_cpu.WIDEST)
def test_a_pin_is_not_timed(loop):
    model, record = grouped_model(), ExecutionPlan(f"gemv_grouped_loop={loop}", execution.DECODER)
    choose_grouped_loop(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    assert [m.grouped_loop for m in model[:2]] == [loop, loop]
    assert record.get("gemv_grouped_loop").reason.startswith(f"pinned by --fast-paths gemv_grouped_loop={loop}")


def test_without_grouped_weights_nothing_is_timed():
    record = ExecutionPlan()
    choose_grouped_loop(nn.Sequential(Linear(64, 96)), record, lambda *a: pytest.fail("no grouped weight"))
    assert record.chosen("gemv_grouped_loop") == "chunks"
    assert record.get("gemv_grouped_loop").reason == "no grouped weight runs the few-row kernel"


def test_without_vnni_or_avx2_nothing_is_timed(monkeypatch):
    """Both orders are the one portable loop there: the default, and the plan says why."""
    portable = gemv_grouped_cpu.LOOPS.index("portable")
    monkeypatch.setattr(gemv_grouped_cpu, "load",
                        lambda: types.SimpleNamespace(vnni=lambda: False, runs=lambda loop: loop == portable))
    record = ExecutionPlan()
    choose_grouped_loop(grouped_model(), record, lambda *a: pytest.fail("one loop only"))
    assert record.chosen("gemv_grouped_loop") == "chunks"
    assert record.get("gemv_grouped_loop").reason == \
        "neither AVX512-VNNI nor AVX2 on this CPU: both are the same portable loop"


@pytest.mark.numerics
def test_a_linear_runs_its_own_loop():
    """Linear.forward's few-row kernel runs its grouped_loop: bit for bit the kernel called with that loop (the two
    loops sum in different orders, so over 1024 inputs their results differ in the last bits)."""
    torch.manual_seed(0)
    m = Linear(1024, 64)
    m.set_grouped(grouped.quantize(m.weight, 4, 32))
    m.gemv_rows = 4
    x, gw = torch.randn(3, 1024), m.grouped
    direct = {loop: gemv_grouped_cpu.gemv_grouped(x, gw.codes, gw.scale, gw.offset, 4, 32, m.bias, loop)
              for loop in gemv_grouped_cpu.WIDEST}
    if gemv_grouped_cpu.vnni() or gemv_grouped_cpu.runs("avx2"):
        assert not torch.equal(*direct.values())
    for loop in gemv_grouped_cpu.WIDEST:
        m.grouped_loop = loop
        assert torch.equal(m(x), direct[loop])


def test_the_pin_is_parsed_as_a_fast_path():
    assert execution.Pins.parse("gemv_grouped_loop=pairs", execution.DECODER).get("gemv_grouped_loop") == "pairs"
    with pytest.raises(ValueError, match="expected auto or one of chunks, pairs"):
        execution.Pins.parse("gemv_grouped_loop=fast", execution.DECODER)
