"""The few-row kernel's per-machine choice (model/matmul_choice.py, choose_gemv): made from measurement,
both paths agree, and an unavailable kernel leaves every Linear on its own path."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from services.common import native
from services.common.plan import ExecutionPlan
from services.decoder.kernels import gemv_cpu
from services.decoder.kernels.gemv_cpu import MAX_ROWS
from services.decoder.model.linear import Linear, quantize_linears
from services.decoder.model.matmul_choice import choose_gemv
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics


def fake_timer(gemv_wins_up_to: dict[int, int]):
    """A GemvTimer where gemv_cpu is twice as fast up to gemv_wins_up_to[out_features] rows, else 1.5x slower."""
    def timer(group, rows):
        wins = rows <= gemv_wins_up_to.get(group[0].out_features, 0)
        return (2e-6, 1e-6) if wins else (1e-6, 1.5e-6)
    return timer


def test_the_first_pass_does_not_count():
    """A first call that favours the library path (its packed copy still in cache) is discarded."""
    seen = set()

    def timer(group, rows):
        first = (group[0].out_features, rows) not in seen
        seen.add((group[0].out_features, rows))
        return (1e-7, 1e-6) if first else (2e-6, 1e-6)

    model = nn.Sequential(Linear(64, 96), Linear(96, 32))
    assert choose_gemv(model, ExecutionPlan(), timer) == f"gemv rows<={MAX_ROWS} on 96x64,32x96"
    assert [m.gemv_rows for m in model] == [MAX_ROWS, MAX_ROWS]


@pytest.mark.parametrize(("lead", "passes"), [(10.0, 1), (2.0, 3)])
def test_a_decisive_timed_pass_ends_the_timing(lead, passes):
    """A lead of more than DECISIVE at every row count in a timed pass skips the passes after it (large
    grouped weights whose own path is 25-70x slower); a closer race runs all of them."""
    calls = []

    def timer(group, rows):
        calls.append(rows)
        return (lead * 1e-6, 1e-6)

    model = nn.Sequential(Linear(64, 96))
    assert choose_gemv(model, ExecutionPlan(), timer) == f"gemv rows<={MAX_ROWS} on 96x64"
    assert len(calls) == MAX_ROWS * (1 + passes)       # the discarded warm-up pass, then the timed ones

@pytest.mark.parametrize("quantized", [False, True])
def test_gemv_rows_follow_the_measurements(quantized):
    model = nn.Sequential(Linear(64, 96), Linear(64, 96), Linear(96, 32, bias=True), Linear(32, 160))
    if quantized:
        quantize_linears(model, "int8")
    record, q = ExecutionPlan(), " int8" if quantized else ""
    summary = choose_gemv(model, record, fake_timer({96: 3, 32: 1}))
    assert [m.gemv_rows for m in model] == [3, 3, 1, 0]
    assert summary == "gemv rows<=3 on 96x64; rows<=1 on 32x96"
    assert [(c.name, c.chosen) for c in record.choices] == [
        (f"gemv 96x64+b{q}", "on rows<=3"), (f"gemv 32x96+b{q}", "on rows<=1"), (f"gemv 160x32+b{q}", "off")]
    # Both paths give the same results within the shared bound, at every row count either runs.
    for rows in range(1, 6):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        fast = model[0](x)
        model[0].gemv_rows = 0
        own = model[0](x)
        model[0].gemv_rows = 3
        # int8's own path meets bf16 activations; gemv_cpu keeps them fp32
        assert_close(fast, own, dtype=torch.bfloat16 if quantized else torch.float32, k=64)
    assert choose_gemv(model, ExecutionPlan(), fake_timer({})) == \
        "gemv: none (the library path was as fast at every shape)"
    assert all(m.gemv_rows == 0 for m in model)



def test_a_near_tie_at_few_rows_does_not_keep_the_kernel_from_more_rows():
    """The library 5 % faster at 2 rows, the kernel 3x faster from 3 rows: rows<=8 (the least summed time over
    1..MAX_ROWS rows); the library far faster from 4: rows<=3; the kernel 10 % faster at 1 row only, no sum well
    below that threshold's: rows<=1, the largest count up to which it won at every count."""
    costs = {96: {1: (1.0, 0.9), 2: (1.0, 1.05), **{r: (3.0, 1.0) for r in range(3, MAX_ROWS + 1)}},
             32: {1: (1.0, 0.5), 2: (1.0, 0.5), 3: (1.0, 0.5), **{r: (1.0, 9.0) for r in range(4, MAX_ROWS + 1)}},
             160: {1: (1.0, 0.9), 2: (1.0, 1.2), 3: (1.0, 1.2), **{r: (1.4, 1.3) for r in range(4, MAX_ROWS + 1)}}}
    model = nn.Sequential(Linear(64, 96), Linear(96, 32), Linear(32, 160))
    assert choose_gemv(model, ExecutionPlan(), lambda group, rows: costs[group[0].out_features][rows]) == \
        f"gemv rows<={MAX_ROWS} on 96x64; rows<=3 on 32x96; rows<=1 on 160x32"


def test_an_unavailable_kernel_is_reported_and_never_used(monkeypatch, caplog):
    def broken(build=True):
        raise native.BuildError("compiling gemv_cpu.cpp failed: boom")
    monkeypatch.setattr(gemv_cpu, "load", broken)
    model = nn.Sequential(Linear(64, 96))
    with caplog.at_level(logging.WARNING, logger="tessera.linear"):
        assert choose_gemv(model, ExecutionPlan()) == "gemv: unavailable (compiling gemv_cpu.cpp failed: boom)"
    assert model[0].gemv_rows == 0 and "boom" in caplog.text
    with pytest.raises(native.BuildError, match="boom"):
        choose_gemv(model, ExecutionPlan("gemv=on"))       # pinned on: no silent fallback


@pytest.mark.parametrize("pin, rows", [("on", gemv_cpu.MAX_ROWS), ("off", 0)])
def test_a_pin_sets_every_linear_without_timing(pin, rows):
    model = nn.Sequential(Linear(64, 96), Linear(96, 32))
    record = ExecutionPlan(f"gemv={pin}")
    choose_gemv(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    assert [m.gemv_rows for m in model] == [rows, rows] and record.chosen("gemv").startswith(pin)
