"""A bf16 model through the Runner with the few-row kernel's bf16 loop pinned each way (gemv_bf16_row,
model/linear.py): the greedy tokens of the reference path (the library's bf16 matmuls, no fast path), and
the choice in the plan GetModelInfo returns, pinned or timed."""
from __future__ import annotations

import pytest
import torch

from services.decoder.engine.step import StepInput
from services.decoder.kernels import gemv_cpu
from services.decoder.kernels.gemv_cpu import BF16_ROWS
from services.decoder.model.linear import Linear
from services.decoder.runner import Runner
from tests.decoder.model.checkpoints import TINY_SHAPE, build
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

BLOCK = 4
CASES = ["llama_gqa4_tied_sharded", "qwen2_gqa2_odd_tied"]
# The decode stack and the model's own layers both run the loop (prefill chunks of up to 4 tokens, and
# decode steps), so each is pinned on in turn.
FAST = "gemv=on,glue=cpp,attention=cpp,screen=off,grammar_mask=xgrammar,decode_stack="
REFERENCE = ("linear=plain,gemv=off,glue=torch,attention=torch,decode_stack=off,screen=off,grammar_mask=unpacked,"
             "huge_pages=off")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build(root, name, seed=30 + i) for i, name in enumerate(CASES)}


@pytest.fixture(scope="module")
def expected(folders):
    """Each case's greedy run on the reference path, once."""
    out = {}
    for name, folder in folders.items():
        reference = Runner.from_folder(folder, "bf16", block_size=BLOCK, num_blocks=200, fast_paths=REFERENCE)
        assert reference.plan.get("gemv_bf16_row").reason == "no bf16 weight runs the few-row kernel"
        out[name] = greedy(reference)
    return out


def greedy(runner: Runner) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Four prompts in chunks of up to 3 tokens, then decode steps of all four rows: each one's greedy
    tokens and every step's logits."""
    alloc = BlockAllocator(200, seed=3)
    seqs = [Seq(str(i), [4 + (7 * i + 13 * j) % 150 for j in range(n)]) for i, n in enumerate([3, 8, 5, 1])]
    got: dict[str, list[int]] = {s.rid: [] for s in seqs}
    logits = []
    for _ in range(10):
        step, batch = runner.logits(StepInput([s.chunk(3, alloc, BLOCK) for s in seqs]))
        logits.append(step.float())
        by_rid = {s.rid: s for s in seqs}
        for chunk, row in zip(batch.sampled, step, strict=True):
            token = int(row.argmax())
            by_rid[chunk.request_id].tokens.append(token)
            got[chunk.request_id].append(token)
    return got, logits


@pytest.mark.parametrize("stack", ["on", "off"])
@pytest.mark.parametrize("loop", BF16_ROWS)
@pytest.mark.parametrize("name", CASES)
def test_greedy_tokens_equal_the_reference_path(folders, expected, name, loop, stack):
    fast = Runner.from_folder(folders[name], "bf16", block_size=BLOCK, num_blocks=200,
                              fast_paths=f"{FAST}{stack},gemv_bf16_row={loop}")
    choice = fast.plan.get("gemv_bf16_row")
    same = "" if gemv_cpu.load().bf16_dot() else "; no bf16 dot product on this CPU: both loops widen to the fp32 one"
    assert choice.chosen == loop and choice.reason == f"pinned by --fast-paths gemv_bf16_row={loop}{same}"
    on_kernel = [m for m in fast.model.modules() if isinstance(m, Linear) and m.gemv_rows]
    assert on_kernel and all(m.bf16_row == loop and m.weight.dtype == torch.bfloat16 for m in on_kernel)
    assert (fast.fused_decode is not None) == (stack == "on")
    (tokens, logits), (expected_tokens, expected_logits) = greedy(fast), expected[name]
    assert tokens == expected_tokens and all(len(t) >= 6 for t in tokens.values())
    for mine, ref in zip(logits, expected_logits, strict=True):
        assert_close(mine, ref, dtype=torch.bfloat16, **TINY_SHAPE)


def test_the_timed_choice_is_in_the_plan(folders):
    """Auto: both loops timed at every row count the kernel runs, the choice and its timings recorded;
    every Linear on the kernel runs the chosen loop."""
    runner = Runner.from_folder(folders[CASES[0]], "bf16", block_size=BLOCK, num_blocks=32,
                                fast_paths=f"{FAST}on")
    choice = runner.plan.get("gemv_bf16_row")
    on_kernel = [m for m in runner.model.modules() if isinstance(m, Linear) and m.gemv_rows]
    assert choice.chosen in BF16_ROWS and all(m.bf16_row == choice.chosen for m in on_kernel)
    if gemv_cpu.load().bf16_dot():
        assert choice.reason == f"timed over {len(on_kernel)} bf16 weights"
        rows = range(1, gemv_cpu.PASS_ROWS + 1)
        assert {(t.rows, t.candidate) for t in choice.timings} == {(r, c) for r in rows for c in BF16_ROWS}
        assert all(t.seconds > 0 for t in choice.timings)
    else:
        assert choice.reason.startswith("no bf16 dot product on this CPU") and not choice.timings
    proto = runner.plan.to_proto()
    recorded = next(c for c in proto.choices if c.name == "gemv_bf16_row")
    assert recorded.chosen == choice.chosen and recorded.reason == choice.reason
    assert len(recorded.timings) == len(choice.timings)
