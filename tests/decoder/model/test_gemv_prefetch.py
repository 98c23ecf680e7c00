"""The few-row kernel asking for dense weights ahead of the row it reads (gemv_cpu.gemv's prefetch; the
gemv_prefetch path, model/matmul_choice.py choose_gemv_prefetch): the same sums bit for bit, in the kernel and
through a Runner with the decode stack on and off; chosen from the plan's timer, pinned by --fast-paths, and
recorded with why."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from services.common import plan as execution
from services.common.plan import ExecutionPlan
from services.decoder.engine.step import StepInput
from services.decoder.kernels import gemv_cpu
from services.decoder.model.linear import Linear
from services.decoder.model.matmul_choice import choose_gemv_prefetch
from services.decoder.runner import Runner
from tests.decoder.model.checkpoints import build
from tests.decoder.runner.driver import BlockAllocator, Seq


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


def test_a_negative_distance_is_refused():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="ahead must be >= 0"):
        gemv_cpu.load().gemv(torch.empty(1, 4), x, w, None, None, 0, -1)


def dense_model() -> nn.Sequential:
    """Two fp32 weights, one bf16 weight, one int8 weight (not dense: never prefetched here)."""
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
    assert [m.gemv_prefetch for m in model] == [expected == "on"] * 3 + [False]
    choice = record.get("gemv_prefetch")
    assert choice.chosen == expected and choice.reason == "timed over 3 dense weights"
    assert summary == f"gemv prefetch: {expected} (timed over 3 dense weights)"
    assert calls == [(3, r) for r in range(1, gemv_cpu.MAX_ROWS + 1)]
    assert [(t.rows, t.candidate) for t in choice.timings] == [(r, c) for r in range(1, 5) for c in ("off", "on")]


@pytest.mark.parametrize("pin", ["off", "on"])
def test_a_pin_is_not_timed(pin):
    model, record = dense_model(), ExecutionPlan(f"gemv_prefetch={pin}", execution.DECODER)
    choose_gemv_prefetch(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    assert [m.gemv_prefetch for m in model][:3] == [pin == "on"] * 3
    assert record.get("gemv_prefetch").reason == f"pinned by --fast-paths gemv_prefetch={pin}"


def test_without_dense_weights_nothing_is_timed():
    model, record = nn.Sequential(Linear(64, 96)), ExecutionPlan()
    model[0].quantize(release=True)
    choose_gemv_prefetch(model, record, lambda *a: pytest.fail("no dense weight"))
    assert record.chosen("gemv_prefetch") == "off"
    assert record.get("gemv_prefetch").reason == "no dense weight runs the few-row kernel"


def logits_of(runner: Runner) -> list[torch.Tensor]:
    """Three prompts in chunks of up to 3 tokens, then decode steps of all three rows: every step's logits."""
    alloc = BlockAllocator(200, seed=5)
    seqs = [Seq(str(i), [4 + (11 * i + 7 * j) % 150 for j in range(n)]) for i, n in enumerate([4, 7, 2])]
    out = []
    for _ in range(8):
        step, batch = runner.logits(StepInput([s.chunk(3, alloc, 4) for s in seqs]))
        out.append(step.float())
        by_rid = {s.rid: s for s in seqs}
        for chunk, row in zip(batch.sampled, step, strict=True):
            by_rid[chunk.request_id].tokens.append(int(row.argmax()))
    return out


@pytest.mark.parametrize("stack", ["on", "off"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_runner_computes_the_same_logits_either_way(tmp_path_factory, dtype, stack):
    """The decode stack's projections and the model's own Linears (prefill chunks of up to 3 tokens) run the
    kernel with the pin: the logits are equal bit for bit."""
    folder = build(tmp_path_factory.mktemp("ckpt"), "llama_gqa4_tied_sharded", seed=41)
    runs = {}
    for pin in ("off", "on"):
        runner = Runner.from_folder(folder, dtype, block_size=4, num_blocks=200,
                                    fast_paths=f"gemv=on,attention=cpp,screen=off,decode_stack={stack},gemv_prefetch={pin}")
        dense = [m for m in runner.model.modules() if isinstance(m, Linear) and m.gemv_rows and not m.released]
        assert dense and all(m.gemv_prefetch == (pin == "on") for m in dense)
        assert (runner.fused_decode is not None) == (stack == "on")
        runs[pin] = logits_of(runner)
    assert all(torch.equal(a, b) for a, b in zip(runs["on"], runs["off"], strict=True))
