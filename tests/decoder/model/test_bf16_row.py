"""The few-row kernel's bf16 loop per machine (model/matmul_choice.py, choose_bf16_row): chosen from the plan's
timer at the model's weights, pinned by --fast-paths gemv_bf16_row, and recorded in the plan with why."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from services.common import plan as execution
from services.common.plan import ExecutionPlan
from services.decoder.kernels import gemv_cpu
from services.decoder.model.linear import Linear
from services.decoder.model.matmul_choice import choose_bf16_row


def bf16_model() -> nn.Sequential:
    """Two bf16 weights on the kernel, one bf16 weight off it, one fp32 weight on it."""
    model = nn.Sequential(Linear(64, 96), Linear(96, 32, bias=False), Linear(32, 48)).to(torch.bfloat16)
    model.append(Linear(48, 16))
    for m, rows in zip(model, (2, 2, 0, 4), strict=True):
        m.gemv_rows = rows
    return model


@pytest.fixture
def bf16_dot(monkeypatch):
    """A CPU with the bf16 dot product, where the two loops differ (the rule is tested on any CPU: the timer is
    given, nothing runs the kernel)."""
    monkeypatch.setattr(gemv_cpu, "load", lambda: types.SimpleNamespace(bf16_dot=lambda: True))


def timer_of(ms: dict[int, tuple[float, float]], calls: list):
    """A Bf16RowTimer: ms[rows] = (rowwise, interleave4) milliseconds per pass."""
    def timer(group, rows):
        calls.append((len(group), rows))
        return {loop: ms[rows][i] * 1e-3 for i, loop in enumerate(gemv_cpu.BF16_ROWS)}
    return timer


@pytest.mark.parametrize("ms,expected", [
    ({1: (9.0, 6.4), 2: (5.1, 4.0)}, "interleave4"),     # faster at every row count
    ({1: (9.0, 6.4), 2: (5.1, 5.2)}, "interleave4"),     # faster at one row, tied at two
    ({1: (6.4, 9.0), 2: (5.1, 4.0)}, "rowwise"),         # slower at one row (the Zen 4 of the bisection)
    ({1: (9.0, 6.4), 2: (4.0, 5.1)}, "rowwise"),         # faster at one row, beaten at two
    ({1: (6.4, 6.2), 2: (5.1, 5.0)}, "rowwise"),         # within the tie rule: the default stays
])
def test_the_loop_follows_the_timings(ms, expected, bf16_dot):
    model, record, calls = bf16_model(), ExecutionPlan(), []
    summary = choose_bf16_row(model, record, timer_of(ms, calls))
    assert [m.bf16_row for m in model] == [expected, expected, "rowwise", "rowwise"]
    choice = record.get("gemv_bf16_row")
    assert choice.chosen == expected and choice.reason == "timed over 2 bf16 weights"
    assert summary == f"gemv bf16 loop: {expected} (timed over 2 bf16 weights)"
    # Each row count up to the most any weight runs on the kernel, over every weight that runs it there.
    assert [(t.rows, t.candidate, t.seconds) for t in choice.timings] == [
        (r, loop, ms[r][i] * 1e-3) for r in (1, 2) for i, loop in enumerate(gemv_cpu.BF16_ROWS)]
    assert calls == [(2, 1), (2, 2)]
    assert "gemv_bf16_row: " + expected in choice.line() and "1 row: rowwise" in choice.line()


@pytest.mark.parametrize("loop", gemv_cpu.BF16_ROWS)
def test_a_pin_is_not_timed(loop, bf16_dot):
    model, record = bf16_model(), ExecutionPlan(f"gemv_bf16_row={loop}", execution.DECODER)
    choose_bf16_row(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    assert [m.bf16_row for m in model][:2] == [loop, loop]
    assert record.chosen("gemv_bf16_row") == loop
    assert record.get("gemv_bf16_row").reason == f"pinned by --fast-paths gemv_bf16_row={loop}"


def test_without_bf16_weights_on_the_kernel_nothing_is_timed():
    model, record = nn.Sequential(Linear(64, 96), Linear(96, 32)), ExecutionPlan()
    for m in model:
        m.gemv_rows = 4
    choose_bf16_row(model, record, lambda *a: pytest.fail("no bf16 weight"))
    assert record.chosen("gemv_bf16_row") == "rowwise"
    assert record.get("gemv_bf16_row").reason == "no bf16 weight runs the few-row kernel"


def test_without_the_bf16_dot_product_nothing_is_timed(monkeypatch):
    """Both loops are the same widening loop there: the default, and the plan says why."""
    monkeypatch.setattr(gemv_cpu, "load", lambda: types.SimpleNamespace(bf16_dot=lambda: False))
    record = ExecutionPlan()
    choose_bf16_row(bf16_model(), record, lambda *a: pytest.fail("one loop only"))
    assert record.chosen("gemv_bf16_row") == "rowwise"
    assert record.get("gemv_bf16_row").reason == "no bf16 dot product on this CPU: both loops widen to the fp32 one"


def test_a_linear_runs_its_own_loop():
    """Linear.forward passes its bf16_row to the kernel (an unknown one is refused there)."""
    m = bf16_model()[0]
    x = torch.randn(1, 64).bfloat16()
    m.bf16_row = "interleave4"
    y = m(x)
    m.bf16_row = "no-such-loop"
    with pytest.raises(ValueError, match="bf16_row 'no-such-loop'"):
        m(x)
    m.bf16_row = "rowwise"
    assert y.shape == (1, 96) and y.dtype == torch.bfloat16


def test_the_pin_is_parsed_as_a_fast_path():
    assert execution.Pins.parse("gemv_bf16_row=interleave4", execution.DECODER).get("gemv_bf16_row") == "interleave4"
    with pytest.raises(ValueError, match="expected auto or one of rowwise, interleave4"):
        execution.Pins.parse("gemv_bf16_row=fast", execution.DECODER)
