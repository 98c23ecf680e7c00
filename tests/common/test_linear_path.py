"""services/common/linear_path.py: the packed-vs-plain choice follows the timings, both
paths compute the same function, and bf16 is packed widened to fp32 where oneDNN cannot pack it."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.common import linear_path
from services.common.linear_path import Plan, Projection, Rule, Shape
from services.common.plan import ExecutionPlan
from services.decoder.model.linear import Linear, pack_linears
from tests.tolerance import assert_close

ROOT = Path(__file__).resolve().parents[2]
needs_onednn = pytest.mark.skipif(linear_path.pack_error(torch.float32) is not None,
                                  reason="no oneDNN linear ops in this torch")


def fake_timer(packed_wins_at, calls=None):
    """A Timer where packed takes 1 s and plain 2 s at rows for which packed_wins_at(rows), else the reverse."""
    def timer(weight, packed, bias, rows):
        if calls is not None:
            calls.append((tuple(weight.shape), rows))
        return (2.0, 1.0) if packed_wins_at(rows) else (1.0, 2.0)
    return timer


def tiny_model(dtype=torch.float32, bias=False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(32, 48, bias=bias), Linear(48, 32, bias=bias), Linear(32, 48, bias=bias))
    return model.to(dtype)


# -- the choice follows the measurement ----------------------------------------------------

@needs_onednn
@pytest.mark.parametrize("wins, expected, packed_at, plain_at", [
    (lambda r: r >= 16, "packed rows>=16", (16, 17, 64, 5000), (1, 4, 15)),
    (lambda r: r < 16, "packed rows 1-15", (1, 4, 15), (16, 64, 5000)),
    (lambda r: True, "packed", (1, 7, 300), ()),
    (lambda r: False, "plain", (), (1, 7, 300)),
])
def test_rule_follows_the_timings(wins, expected, packed_at, plain_at):
    plan = linear_path.plan([(torch.randn(48, 32), None)], "auto", timer=fake_timer(wins))
    rule = plan.rule(torch.empty(48, 32), None)
    assert str(rule) == expected and plan.summary == f"auto float32: {expected} on 48x32"
    assert all(rule.use_packed(n) for n in packed_at)
    assert not any(rule.use_packed(n) for n in plain_at)


@needs_onednn
def test_forward_takes_the_path_its_rule_picks(monkeypatch):
    """Linear (decoder) and Projection (pooling) call the packed op exactly for the rows the timings favour."""
    model = tiny_model()
    monkeypatch.setattr(linear_path, "time_both", fake_timer(lambda r: r >= 16))
    summary = pack_linears(model, ExecutionPlan())
    assert summary == "auto float32: packed rows>=16 on 48x32,32x48"
    weight = torch.randn(48, 32)
    proj = Projection(weight, None, linear_path.plan([(weight, None)], "auto", fake_timer(lambda r: r < 4)))
    packed_calls = []
    real = linear_path.packed_linear
    monkeypatch.setattr(linear_path, "packed_linear", lambda *a: packed_calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 15, 16, 64):
        model(torch.randn(rows, 32))
        proj(torch.randn(rows, 32))
    assert packed_calls == [1] + [16] * 3 + [64] * 3


def test_passes_keep_the_fastest_time():
    """A load burst that slows one pass of packed does not flip the verdict."""
    shape = Shape(8, 8, torch.float32, False)
    seen = {}

    def timer(weight, packed, bias, rows):
        seen[rows] = seen.get(rows, 0) + 1
        return (2.0, 50.0 if seen[rows] == 2 else 1.0)   # pass 2 of packed stalls

    rule, timings = linear_path.measure_rules({shape: (torch.randn(8, 8), None, None)}, timer)[shape]
    assert rule == Rule.always(True) and all(t[1:] == (2.0, 1.0) for t in timings)


def test_ties_keep_the_neighbouring_verdict_and_big_shapes_skip_big_buckets():
    times = {1: (2.0, 1.0), 4: (1.0, 1.02), 16: (1.0, 1.05), 64: (1.0, 2.0), 256: (1.0, 1.01)}
    calls = []

    def timer(weight, packed, bias, rows):
        calls.append((weight.shape[0], rows))
        return times[rows]

    small, head = Shape(8, 8, torch.float32, False), Shape(49152, 576, torch.float32, False)
    rule, timings = linear_path.measure_rules({small: (torch.randn(8, 8), None, None)}, timer)[small]
    assert rule == Rule((1, 64), (True, False)) and [t[0] for t in timings] == list(linear_path.ROWS)
    calls.clear()
    # a SmolLM2 LM head: up to 64 rows (MAX_MACS), once per pass
    rule, _ = linear_path.measure_rules({head: (torch.empty(49152, 576), None, None)}, timer)[head]
    assert calls == [(49152, 1), (49152, 4), (49152, 16), (49152, 64)] * linear_path.PASSES
    assert str(rule) == "packed rows 1-63"
    assert Rule.from_verdicts([(1, None), (4, False), (16, None)]) == Rule.always(False)
    assert Rule.from_verdicts([(1, None), (4, None)]) == Rule.always(False)


needs_bf16_packing = pytest.mark.skipif(linear_path.pack_error(torch.bfloat16) is not None
                                        or linear_path.pack_error(torch.float32) is not None,
                                        reason="oneDNN cannot pack both bf16 and fp32 on this CPU")


@needs_bf16_packing
def test_bf16_shapes_get_the_packed_copy_that_timed_faster(monkeypatch):
    """Per bf16 shape, the widened fp32 copy is kept only where it beat the bf16 one (plan.beats)
    (summed over COPY_ROWS); the packed-vs-plain rule is then timed on the kept copy, and a shape whose
    rule is not timed at COPY_ROWS[0] (MAX_MACS) is never offered the choice."""
    faster = {64: "wide", 48: "own", 40: "tie"}          # by out_features
    copy_calls, rule_copies = [], {}

    def copy_timer(weight, own, wide, bias, rows):
        assert own.dtype == torch.bfloat16 and wide.dtype == torch.float32 and rows in linear_path.COPY_ROWS
        copy_calls.append((weight.shape[0], rows))
        return {"wide": (2.0, 1.0), "own": (1.0, 2.0), "tie": (1.0, 0.97)}[faster[weight.shape[0]]]

    def timer(weight, packed, bias, rows):
        rule_copies[weight.shape[0]] = packed.dtype
        return (2.0, 1.0)                                  # packed wins everywhere

    monkeypatch.setattr(linear_path, "MAX_MACS", 300_000)   # 200x32 stops at 16 rows, the others at 64
    weights = [(torch.randn(n, 32).bfloat16(), None) for n in (64, 48, 40, 200)]
    plan = linear_path.plan(weights, "auto", timer=timer, copy_timer=copy_timer)
    assert {n for n, _ in copy_calls} == {64, 48, 40}
    assert len(copy_calls) == linear_path.COPY_PASSES * sum(
        len([r for r in linear_path.COPY_ROWS if r in linear_path.buckets(Shape(n, 32, torch.bfloat16, False))])
        for n in (64, 48, 40))
    assert rule_copies == {64: torch.float32, 48: torch.bfloat16, 40: torch.bfloat16, 200: torch.bfloat16}
    assert plan.summary == ("auto bfloat16: packed on 64x32,48x32,40x32,200x32 (bfloat16 packed widened to "
                            "float32 on 64x32: faster at 64/256 rows)")
    projections = [Projection(w, b, plan) for w, b in weights]
    assert [p.packed.dtype for p in projections] == [torch.float32] + [torch.bfloat16] * 3
    model = tiny_model(torch.bfloat16)                   # the decoder's Linear takes the same copies
    monkeypatch.setattr(linear_path, "time_both", timer)
    monkeypatch.setattr(linear_path, "time_copies", lambda w, own, wide, b, rows: (2.0, 1.0) if w.shape[0] == 48
                        else (1.0, 2.0))
    pack_linears(model, ExecutionPlan())
    assert [m.packed.dtype for m in model] == [torch.float32, torch.bfloat16, torch.float32]


@needs_bf16_packing
@pytest.mark.numerics
def test_a_widened_copy_computes_the_bf16_function():
    """x and bias widened, fp32 sums, one rounding to bf16: F.linear over the exactly widened weight."""
    torch.manual_seed(0)
    w, b = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    plan = Plan("auto", {Shape.of(w, b): Rule.always(True)}, copies={Shape.of(w, b): torch.float32})
    proj = Projection(w, b, plan)
    x = torch.randn(17, 64).bfloat16()
    with torch.inference_mode():
        got = proj(x)
    assert proj.packed.dtype == torch.float32 and got.dtype == torch.bfloat16
    assert_close(got, F.linear(x.float(), w.float(), b.float()).bfloat16(), dtype=torch.bfloat16, k=64)


def test_forced_modes_do_not_time(monkeypatch):
    def refuse(*a):
        raise AssertionError("forced modes must not measure")
    w = torch.randn(16, 8)
    assert linear_path.plan([(w, None)], "plain", refuse).summary == "plain float32: plain on 16x8"
    if linear_path.pack_error(torch.float32) is None:
        pinned = ExecutionPlan("linear=packed")
        assert linear_path.plan([(w, torch.zeros(16))], timer=refuse, record=pinned).summary == \
            "packed float32: packed on 16x8+b"
        assert pinned.chosen("linear 16x8+b") == "packed"
        assert pinned.get("linear 16x8+b").reason == "pinned by --fast-paths linear=packed"
    with pytest.raises(ValueError, match="linear path 'fastest'"):
        linear_path.resolve_mode("fastest")


def test_unknown_shapes_and_other_devices_run_plain():
    plan = Plan("auto", {})
    assert plan.rule(torch.empty(3, 3), None) == Rule.always(False)
    assert plan.summary == "auto: plain (no CPU weights)"
    proj = Projection(torch.eye(3), torch.ones(3), plan)
    assert proj.packed is None and torch.equal(proj(torch.eye(3)), torch.eye(3) + 1)
    assert Shape.of(torch.empty(5, 7), torch.empty(5)) == Shape(5, 7, torch.float32, True)


# -- both paths compute the same function --------------------------------------------------

@needs_onednn
@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_and_plain_agree(dtype, bias):
    if linear_path.pack_error(dtype):
        pytest.skip(linear_path.pack_error(dtype))
    packed, plain = tiny_model(dtype, bias), tiny_model(dtype, bias)
    assert pack_linears(packed, ExecutionPlan("linear=packed")).startswith("packed")
    assert pack_linears(plain, ExecutionPlan("linear=plain")).startswith("plain")
    assert all(m.packed is not None for m in packed) and all(m.packed is None for m in plain)
    with torch.inference_mode():
        for rows in (1, 5, 64):
            x = torch.randn(rows, 32, dtype=dtype)
            expected = plain(x)
            assert_close(packed(x), expected, dtype=dtype, k=48, depth=3, what=f"{rows} rows")
            # and the plain path is F.linear itself
            ref = F.linear(F.linear(F.linear(x, plain[0].weight, plain[0].bias), plain[1].weight,
                                    plain[1].bias), plain[2].weight, plain[2].bias)
            assert torch.equal(expected, ref)


@needs_onednn
@pytest.mark.numerics
@pytest.mark.parametrize("copy", [torch.float32, torch.bfloat16, "widened"])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("gelu, residual", [("none", False), ("tanh", False), (None, True), ("none", True)])
def test_post_ops_are_gelu_and_the_residual_after_the_linear(copy, packed, gelu, residual):
    """Projection(x, gelu=, residual=) on either path is F.gelu(F.linear(x)) (+ residual): oneDNN's post-ops on the
    packed copy, its own dtype's or a bf16 weight's widened fp32 copy, and the same ops after F.linear on the plain."""
    dtype = torch.bfloat16 if copy != torch.float32 else torch.float32
    unpackable = linear_path.pack_error(torch.float32 if copy == "widened" else dtype)
    if packed and unpackable:      # e.g. bf16 on a CPU without AVX-512, where oneDNN cannot pack it
        pytest.skip(unpackable)
    torch.manual_seed(0)
    w, b = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    shape = Shape.of(w, b)
    plan = Plan("auto", {shape: Rule.always(packed)}, copies={shape: torch.float32} if copy == "widened" else {})
    proj = Projection(w, b, plan)
    assert (proj.packed is not None) == packed
    x, r = torch.randn(37, 64).to(dtype), torch.randn(37, 96).to(dtype) if residual else None
    with torch.inference_mode():
        got = proj(x, gelu=gelu, residual=r)
        wide = F.linear(x.float(), w.float(), b.float())
        want = (wide if gelu is None else F.gelu(wide, approximate=gelu)).to(dtype)
        want = want if r is None else want + r
    assert got.dtype == dtype and got.shape == (37, 96)
    assert_close(got, want, dtype=dtype, k=64, depth=1 + residual, what=f"{copy} packed={packed}")


# -- bf16 on an AVX2-only CPU ----------------------------------------------------------------

_AVX2_CHILD = r"""
import json, logging, torch
import torch.nn.functional as F
from services.common import linear_path
from services.common.plan import ExecutionPlan
from services.decoder.model.linear import Linear, pack_linears


class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))


records = []
logging.getLogger("tessera.linear_path").setLevel(logging.INFO)
logging.getLogger("tessera.linear_path").addHandler(Keep())
error = linear_path.pack_error(torch.bfloat16)
torch.manual_seed(0)
model = torch.nn.Sequential(Linear(64, 96), Linear(96, 64)).to(torch.bfloat16)
summary = pack_linears(model, ExecutionPlan("linear=packed"))
x = torch.randn(17, 64, dtype=torch.bfloat16)
with torch.inference_mode():
    y = model(x)
    # The same function in fp32 over the exactly widened weights, each layer's output rounded to bf16.
    h = F.linear(x.float(), model[0].weight.float(), model[0].bias.float()).bfloat16()
    ref = F.linear(h.float(), model[1].weight.float(), model[1].bias.float()).bfloat16()
print(json.dumps({"error": error, "summary": summary, "y": y.float().tolist(), "ref": ref.float().tolist(),
                  "packed": [str(m.packed.dtype) for m in model], "records": records}))
"""


@needs_onednn
@pytest.mark.numerics
def test_bf16_is_packed_widened_where_onednn_cannot_pack_it():
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _AVX2_CHILD], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["error"] is None:
        pytest.skip("ONEDNN_MAX_CPU_ISA=AVX2 still packs bf16 on this CPU")
    assert "bf16 path needs the cpu support" in got["error"]
    assert got["packed"] == ["torch.float32", "torch.float32"]
    assert got["summary"] == "packed bfloat16: packed on 96x64+b,64x96+b (bfloat16 packed widened to float32)"
    # Both sides sum exact products in fp32 (in another order) and round each layer once to bf16.
    assert_close(torch.tensor(got["y"]), torch.tensor(got["ref"]), dtype=torch.bfloat16, k=96, depth=2)
    assert not [m for level, m in got["records"] if level == "WARNING"]


def test_logs_one_line_per_plan(caplog):
    caplog.set_level(logging.INFO, logger="tessera.linear_path")
    linear_path.plan([(torch.randn(8, 4), None), (torch.randn(8, 4), None)], "plain")
    assert [r.getMessage().split(" [")[0] for r in caplog.records] == ["linear path plain float32: plain on 8x4"]


def test_weights_off_cpu_are_one_plain_choice():
    record = ExecutionPlan()
    plan = linear_path.plan([(torch.empty(4, 4, device="meta"), None)], record=record)
    assert plan.rules == {} and record.chosen("linear") == "plain"
    assert record.get("linear").reason == "no CPU weights: F.linear is the only path"
