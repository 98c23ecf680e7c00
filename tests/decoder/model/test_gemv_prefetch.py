"""The few-row kernels asking for the weights ahead of the row they read (the gemv_prefetch path,
model/matmul_choice.py choose_gemv_prefetch): the same sums bit for bit, in the kernels and through the decode
stack (fp32, bf16, int8 and grouped 4-bit weights); handed from the plan to a Runner's Linears and stack; chosen
from the plan's timer, pinned by --fast-paths, and recorded with why."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from services.common import plan as execution
from services.common.plan import ExecutionPlan
from services.decoder.kernels import gemv_cpu, gemv_grouped_cpu
from services.decoder.kernels.decode_stack_cpu import Shape, decode_stack, make_stack
from services.decoder.model import grouped
from services.decoder.model.linear import Linear
from services.decoder.model.matmul_choice import choose_gemv_prefetch
from services.decoder.runner import Runner, fused_decode
from tests.decoder.kernels.test_decode_stack_cpu import DTYPES, clone, model, step
from tests.decoder.model.checkpoints import build


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("weight,x", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                      (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("loop", gemv_cpu.BF16_ROWS)
def test_the_kernel_sums_the_same_with_and_without(rows, weight, x, loop):
    """Odd widths (a partial vector step, a row count off the thread split), bias: equal bit for bit."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(301, 203, generator=g).to(weight)
    xs = torch.randn(rows, 203, generator=g).to(x)
    bias = torch.randn(301, generator=g)
    off = gemv_cpu.gemv(xs, w, None, bias, loop, prefetch=False)
    on = gemv_cpu.gemv(xs, w, None, bias, loop, prefetch=True)
    assert torch.equal(on, off)
    assert gemv_cpu.ahead(True) == gemv_cpu.PREFETCH_BYTES > 0 and gemv_cpu.ahead(False) == 0


@pytest.mark.parametrize("rows", [1, 4])
def test_int8_weights_sum_the_same_with_and_without(rows):
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-127, 128, (301, 203), generator=g, dtype=torch.int8)
    scale, xs = torch.rand(301, generator=g) / 100, torch.randn(rows, 203, generator=g)
    assert torch.equal(gemv_cpu.gemv(xs, q, scale, prefetch=True), gemv_cpu.gemv(xs, q, scale, prefetch=False))


def test_a_negative_distance_is_refused():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="ahead must be >= 0"):
        gemv_cpu.load().gemv(torch.empty(1, 4), x, w, None, None, 0, -1)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("bits", grouped.BITS)
@pytest.mark.parametrize("loop", [loop for loop in gemv_grouped_cpu.LOOPS if gemv_grouped_cpu.runs(loop)])
def test_grouped_weights_sum_the_same_with_and_without(rows, bits, loop):
    """Every loop this CPU runs; rows of 48 bytes of codes, so the row ahead is 170 rows on."""
    g = torch.Generator().manual_seed(bits)
    gw = grouped.quantize(torch.randn(301, 96, generator=g), bits, 32)
    xs = torch.randn(rows, 96, generator=g)
    on, off = (grouped.grouped_linear(xs, gw, None, "gemv", loop=loop, prefetch=p) for p in (True, False))
    assert torch.equal(on, off)
    with pytest.raises(RuntimeError, match="ahead must be >= 0"):
        gemv_grouped_cpu.gemv_grouped(xs, gw.codes, gw.scale, gw.offset, bits, 32, None, loop, -1)


def dense_model() -> nn.Sequential:
    """Two fp32 weights, one bf16 weight, one int8 weight."""
    model = nn.Sequential(Linear(64, 96), Linear(96, 32, bias=False), Linear(32, 48).to(torch.bfloat16),
                          Linear(48, 16))
    model[3].quantize(release=True)
    return model


def timer_of(ms: dict[int, tuple[float, float]], calls: list):
    """A timer: ms[rows] = (off, on) milliseconds per pass."""
    def timer(group, rows):
        calls.append((len(group), rows))
        return {"off": ms[rows][0] * 1e-3, "on": ms[rows][1] * 1e-3}
    return timer


TIES = {1: (9.0, 9.0), 2: (9.5, 9.5), 3: (10.0, 10.0)}


@pytest.mark.parametrize("ms,expected", [
    ({**TIES, 4: (10.4, 8.0)}, "on"),                              # faster at four rows, tied elsewhere
    ({1: (9.0, 7.0), 2: (9.5, 7.1), 3: (10.0, 7.2), 4: (10.4, 7.3)}, "on"),   # faster everywhere
    ({1: (9.0, 7.0), 2: (9.5, 7.1), 3: (10.0, 12.0), 4: (10.4, 7.3)}, "off"),  # beaten at three rows
    ({**TIES, 4: (10.4, 10.3)}, "off"),                            # within the tie rule everywhere: the default
])
def test_the_choice_follows_the_timings(ms, expected):
    """Unlike the loops that change the order of the sums, a win at any row count counts: the sums are the same."""
    model, record, calls = dense_model(), ExecutionPlan(), []
    summary = choose_gemv_prefetch(model, record, timer_of(ms, calls))
    assert [m.gemv_prefetch for m in model] == [expected == "on"] * 4
    choice = record.get("gemv_prefetch")
    assert choice.chosen == expected and choice.reason == "timed over 4 weights"
    assert summary == f"gemv prefetch: {expected} (timed over 4 weights)"
    assert calls == [(4, r) for r in range(1, gemv_cpu.PASS_ROWS + 1)]
    assert [(t.rows, t.candidate) for t in choice.timings] == [(r, c) for r in range(1, 5) for c in ("off", "on")]


@pytest.mark.parametrize("pin", ["off", "on"])
def test_a_pin_is_not_timed(pin):
    model, record = dense_model(), ExecutionPlan(f"gemv_prefetch={pin}", execution.DECODER)
    choose_gemv_prefetch(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    assert [m.gemv_prefetch for m in model] == [pin == "on"] * 4
    assert record.get("gemv_prefetch").reason == f"pinned by --fast-paths gemv_prefetch={pin}"


def test_without_weights_for_the_kernel_nothing_is_timed():
    record = ExecutionPlan()
    choose_gemv_prefetch(nn.Sequential(nn.ReLU()), record, lambda *a: pytest.fail("no weight"))
    assert record.chosen("gemv_prefetch") == "off"
    assert record.get("gemv_prefetch").reason == "no weight runs the few-row kernel"


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4", "int4_bf16"])
def test_the_decode_stack_sums_the_same_with_and_without(kind, rows):
    """Every projection of a two-layer stack with prefetch on against the same stack with it off: equal bit for
    bit, the KV cache included."""
    g = torch.Generator().manual_seed(11)
    shape = Shape(4, 2, 64, hidden=128, intermediate=192, eps=1e-6)
    layers, final = model(kind, shape, False, True, 64, 16, g)
    fetching = clone(layers)
    for w in fetching:
        for p in (w.qkv, w.o, w.gate_up, w.down):
            p.prefetch = True
    x, cos, sin, slots, tables, lens = step(rows, [5, 70, 33, 128][:rows], 16, 64, shape, DTYPES[kind], g)
    off = decode_stack(make_stack(shape, layers, final), x.clone(), cos, sin, slots, tables, lens)
    on = decode_stack(make_stack(shape, fetching, final), x.clone(), cos, sin, slots, tables, lens)
    assert torch.equal(on, off)
    assert all(torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)
               for a, b in zip(layers, fetching, strict=True))


def test_the_runner_hands_the_choice_to_its_linears_and_the_stack(tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("ckpt"), "llama_gqa4_tied_sharded", seed=41)
    runner = Runner.from_folder(folder, "fp32", block_size=4, num_blocks=64, quantization="int8",
                                fast_paths="gemv=on,attention=cpp,decode_stack=on,gemv_prefetch=on")
    assert runner.plan.get("gemv_prefetch").reason == "pinned by --fast-paths gemv_prefetch=on"
    on_kernel = [m for m in runner.model.modules() if isinstance(m, Linear) and m.gemv_rows]
    assert on_kernel and all(m.gemv_prefetch for m in on_kernel)
    layer = runner.model.model.layers[0]
    assert all(fused_decode._projection(m, False).prefetch for m in (layer.self_attn.qkv, layer.mlp.down_proj))
