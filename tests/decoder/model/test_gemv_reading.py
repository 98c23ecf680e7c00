"""How the few-row kernels read the weights: asking for them ahead of the row they read (the gemv_prefetch path,
model/matmul_choice.py choose_gemv_prefetch) and each thread's rows front to back or from two halves of its share
in turn (gemv_streams, choose_gemv_streams). The same sums bit for bit, in the kernels and through the decode stack
(fp32, bf16, int8 and grouped 4-bit weights); handed from the plan to a Runner's Linears and stack; chosen from the
plan's timer, pinned by --fast-paths, and recorded with why."""
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
from services.decoder.model.matmul_choice import choose_gemv_prefetch, choose_gemv_streams
from services.decoder.runner import Runner, fused_decode
from tests.decoder.kernels.test_decode_stack_cpu import DTYPES, clone, model, step
from tests.decoder.model.checkpoints import build

# Every way of reading but the default (no prefetch, one stream), as (prefetch, streams).
READINGS = [(True, "one"), (False, "two"), (True, "two")]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("weight,x", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                      (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("loop", gemv_cpu.BF16_ROWS)
def test_the_kernel_sums_the_same_however_it_reads(rows, weight, x, loop):
    """Odd widths (a partial vector step, a row count off the thread split, shares of odd length), bias: equal bit
    for bit."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(301, 203, generator=g).to(weight)
    xs = torch.randn(rows, 203, generator=g).to(x)
    bias = torch.randn(301, generator=g)
    plain = gemv_cpu.gemv(xs, w, None, bias, loop)
    for prefetch, streams in READINGS:
        assert torch.equal(gemv_cpu.gemv(xs, w, None, bias, loop, prefetch, streams), plain), (prefetch, streams)
    assert gemv_cpu.reading(True) == (gemv_cpu.PREFETCH_BYTES, 1) and gemv_cpu.reading(False) == (0, 1)
    assert gemv_cpu.reading(False, "two") == gemv_cpu.reading(True, "two") == (gemv_cpu.PREFETCH_BYTES, 2)


@pytest.mark.parametrize("rows", [1, 4, 5])
def test_int8_weights_sum_the_same_however_they_are_read(rows):
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-127, 128, (301, 203), generator=g, dtype=torch.int8)
    scale, xs = torch.rand(301, generator=g) / 100, torch.randn(rows, 203, generator=g)
    plain = gemv_cpu.gemv(xs, q, scale)
    for prefetch, streams in READINGS:
        assert torch.equal(gemv_cpu.gemv(xs, q, scale, prefetch=prefetch, streams=streams), plain)


def test_a_negative_distance_or_three_streams_is_refused():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="ahead must be >= 0"):
        gemv_cpu.load().gemv(torch.empty(1, 4), x, w, None, None, 0, -1, 1)
    with pytest.raises(RuntimeError, match="streams must be 1 or 2"):
        gemv_cpu.load().gemv(torch.empty(1, 4), x, w, None, None, 0, 0, 3)


@pytest.mark.parametrize("rows", [1, 4, 5])
@pytest.mark.parametrize("bits", grouped.BITS)
@pytest.mark.parametrize("loop", [loop for loop in gemv_grouped_cpu.LOOPS if gemv_grouped_cpu.runs(loop)])
def test_grouped_weights_sum_the_same_however_they_are_read(rows, bits, loop):
    """Every loop this CPU runs; rows of 48 bytes of codes, so the row ahead is 170 rows on."""
    g = torch.Generator().manual_seed(bits)
    gw = grouped.quantize(torch.randn(301, 96, generator=g), bits, 32)
    xs = torch.randn(rows, 96, generator=g)
    plain = grouped.grouped_linear(xs, gw, None, "gemv", loop=loop)
    for prefetch, streams in READINGS:
        assert torch.equal(grouped.grouped_linear(xs, gw, None, "gemv", loop=loop, prefetch=prefetch,
                                                  streams=streams), plain)
    with pytest.raises(RuntimeError, match="ahead must be >= 0"):
        gemv_grouped_cpu.gemv_grouped(xs, gw.codes, gw.scale, gw.offset, bits, 32, None, loop, -1)
    with pytest.raises(RuntimeError, match="streams must be 1 or 2"):
        gemv_grouped_cpu.gemv_grouped(xs, gw.codes, gw.scale, gw.offset, bits, 32, None, loop, 0, 0)


def dense_model() -> nn.Sequential:
    """Two fp32 weights, one bf16 weight, one int8 weight."""
    model = nn.Sequential(Linear(64, 96), Linear(96, 32, bias=False), Linear(32, 48).to(torch.bfloat16),
                          Linear(48, 16))
    model[3].quantize(release=True)
    return model


# path: (its chooser, the Linear attribute it sets, that attribute's value per candidate, the summary's words)
PATHS = {
    "gemv_prefetch": (choose_gemv_prefetch, "gemv_prefetch", {"off": False, "on": True}, "gemv prefetch"),
    "gemv_streams": (choose_gemv_streams, "gemv_streams", {"one": "one", "two": "two"}, "gemv streams"),
}


def timer_of(ms: dict[int, tuple[float, float]], calls: list, candidates: tuple[str, str]):
    """A timer: ms[rows] = (default, challenger) milliseconds per pass."""
    def timer(group, rows):
        calls.append((len(group), rows))
        return {candidates[0]: ms[rows][0] * 1e-3, candidates[1]: ms[rows][1] * 1e-3}
    return timer


TIES = {1: (9.0, 9.0), 2: (9.5, 9.5), 3: (10.0, 10.0)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ms,challenger", [
    ({**TIES, 4: (10.4, 8.0)}, True),                              # faster at four rows, tied elsewhere
    ({1: (9.0, 7.0), 2: (9.5, 7.1), 3: (10.0, 7.2), 4: (10.4, 7.3)}, True),   # faster everywhere
    ({1: (9.0, 7.0), 2: (9.5, 7.1), 3: (10.0, 12.0), 4: (10.4, 7.3)}, False),  # beaten at three rows
    ({**TIES, 4: (10.4, 10.3)}, False),                            # within the tie rule everywhere: the default
])
def test_the_choice_follows_the_timings(path, ms, challenger):
    """Unlike the loops that change the order of the sums, a win at any row count counts: the sums are the same."""
    choose, attribute, values, words = PATHS[path]
    candidates = execution.PATHS[path]
    expected = candidates[challenger]
    model, record, calls = dense_model(), ExecutionPlan(), []
    summary = choose(model, record, timer_of(ms, calls, candidates))
    assert [getattr(m, attribute) for m in model] == [values[expected]] * 4
    choice = record.get(path)
    assert choice.chosen == expected and choice.reason == "timed over 4 weights"
    assert summary == f"{words}: {expected} (timed over 4 weights)"
    assert calls == [(4, r) for r in range(1, gemv_cpu.PASS_ROWS + 1)]
    assert [(t.rows, t.candidate) for t in choice.timings] == [(r, c) for r in range(1, 5) for c in candidates]


@pytest.mark.parametrize("path,pin", [(path, pin) for path in PATHS for pin in execution.PATHS[path]])
def test_a_pin_is_not_timed(path, pin):
    choose, attribute, values, _ = PATHS[path]
    model, record = dense_model(), ExecutionPlan(f"{path}={pin}", execution.DECODER)
    choose(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    assert [getattr(m, attribute) for m in model] == [values[pin]] * 4
    assert record.get(path).reason == f"pinned by --fast-paths {path}={pin}"


@pytest.mark.parametrize("path", PATHS)
def test_without_weights_for_the_kernel_nothing_is_timed(path):
    record = ExecutionPlan()
    PATHS[path][0](nn.Sequential(nn.ReLU()), record, lambda *a: pytest.fail("no weight"))
    assert record.chosen(path) == execution.PATHS[path][0]
    assert record.get(path).reason == "no weight runs the few-row kernel"


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4", "int4_bf16"])
def test_the_decode_stack_sums_the_same_however_it_reads(kind, rows):
    """Every projection of a two-layer stack reading each other way against the same stack reading the default
    way: equal bit for bit, the KV cache included."""
    g = torch.Generator().manual_seed(11)
    shape = Shape(4, 2, 64, hidden=128, intermediate=192, eps=1e-6)
    layers, final = model(kind, shape, False, True, 64, 16, g)
    x, cos, sin, slots, tables, lens = step(rows, [5, 70, 33, 128][:rows], 16, 64, shape, DTYPES[kind], g)
    plain = decode_stack(make_stack(shape, layers, final), x.clone(), cos, sin, slots, tables, lens)
    for prefetch, streams in READINGS:
        other = clone(layers)
        for w in other:
            for p in (w.qkv, w.o, w.gate_up, w.down):
                p.prefetch, p.streams = prefetch, streams
        assert torch.equal(decode_stack(make_stack(shape, other, final), x.clone(), cos, sin, slots, tables, lens),
                           plain), (prefetch, streams)
        assert all(torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)
                   for a, b in zip(layers, other, strict=True))


def test_the_runner_hands_the_choice_to_its_linears_and_the_stack(tmp_path_factory):
    folder = build(tmp_path_factory.mktemp("ckpt"), "llama_gqa4_tied_sharded", seed=41)
    runner = Runner.from_folder(folder, "fp32", block_size=4, num_blocks=64, quantization="int8",
                                fast_paths="gemv=on,attention=cpp,decode_stack=on,gemv_prefetch=on,gemv_streams=two")
    assert runner.plan.get("gemv_prefetch").reason == "pinned by --fast-paths gemv_prefetch=on"
    assert runner.plan.get("gemv_streams").reason == "pinned by --fast-paths gemv_streams=two"
    on_kernel = [m for m in runner.model.modules() if isinstance(m, Linear) and m.gemv_rows]
    assert on_kernel and all(m.gemv_prefetch and m.gemv_streams == "two" for m in on_kernel)
    layer = runner.model.model.layers[0]
    assert all(fused_decode._projection(m, False).prefetch and fused_decode._projection(m, False).streams == "two"
               for m in (layer.self_attn.qkv, layer.mlp.down_proj))
