"""Which fp32 matmuls split their products in bf16 halves (services/common/split_products.py): the row count
each weight shape starts at, from the load-time timings, under every precision and pin; a weight that never
takes it holds no panels."""
from __future__ import annotations

import pytest
import torch

from services.common import split_products, tile_unit
from services.common.plan import ExecutionPlan
from tests.common.test_tile_unit import needs_amx


def _targets(*shapes):
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g)
        out.append(split_products.Target(w, None, lambda x, w=w: torch.nn.functional.linear(x, w)))
    return out


def _timer(split_wins_at):
    calls = []

    def timer(target, panels, rows):
        calls.append((tuple(target.weight.shape), rows))
        return {"library": 1.0, "split": 0.5 if rows in split_wins_at else 1.0}
    return timer, calls


def test_highest_keeps_every_product_in_fp32():
    plan = ExecutionPlan()
    splits = split_products.choose(_targets((32, 64)), plan, "highest")
    assert splits == [split_products.Split()] and not splits[0].takes(256)
    assert plan.chosen("split_products") == "off" and "highest" in plan.get("split_products").reason


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="--matmul-precision 'medium': expected one of highest, high"):
        split_products.choose(_targets((32, 64)), ExecutionPlan(), "medium")


def test_without_the_tile_unit_it_is_off_and_a_pin_on_is_refused(monkeypatch):
    monkeypatch.setattr(tile_unit, "amx", lambda: False)
    plan = ExecutionPlan()
    assert split_products.choose(_targets((32, 64)), plan, "high") == [split_products.Split()]
    assert "no tile unit" in plan.get("split_products").reason
    with pytest.raises(ValueError, match="split_products=on: this CPU or build has no tile unit"):
        split_products.choose(_targets((32, 64)), ExecutionPlan("split_products=on"), "high")


def test_bf16_weights_are_not_split():
    targets = [split_products.Target(t.weight.bfloat16(), None, t.own) for t in _targets((32, 64))]
    plan = ExecutionPlan()
    assert split_products.choose(targets, plan, "high") == [split_products.Split()]
    assert plan.get("split_products").reason == "no fp32 CPU weights"


@needs_amx
@pytest.mark.parametrize("wins,start", [((16, 64, 256), 16), ((64, 256), 64), ((16, 256), 256), ((16, 64), 0),
                                        ((), 0)])
def test_it_starts_where_it_won_at_that_count_and_every_larger_one(wins, start):
    timer, calls = _timer(wins)
    plan = ExecutionPlan()
    targets = _targets((32, 64), (48, 64), (32, 64))
    splits = split_products.choose(targets, plan, "high", timer)
    # Timed once per shape, at every count, on its first weight.
    assert sorted(calls) == sorted((shape, rows) for shape in ((32, 64), (48, 64)) for rows in split_products.ROWS)
    assert [s.start for s in splits] == [start] * 3
    assert all((s.panels is not None) == bool(start) for s in splits)
    assert plan.chosen("split_products 32x64") == (f"on rows>={start}" if start else "off")
    if start:
        x = torch.randn(start, 64)
        assert splits[2].takes(start) and not splits[2].takes(start - 1)
        assert torch.equal(splits[2](x, None), tile_unit.gemm_panels_split(x, splits[2].panels, 32))


@needs_amx
def test_pins_run_it_everywhere_or_nowhere_untimed():
    timer, calls = _timer(())
    on = split_products.choose(_targets((32, 64)), ExecutionPlan("split_products=on"), "high", timer)
    assert on[0].start == 1 and on[0].takes(1) and not calls
    off = split_products.choose(_targets((32, 64)), ExecutionPlan("split_products=off"), "high", timer)
    assert off == [split_products.Split()] and not calls

