"""RoPE recipes through the real engine (core + runner) against transformers' greedy generate.

Each recipe's checkpoint (tests/decoder/model/checkpoints.py ROPE_CASES: Llama 3.1 and 3.2, Qwen2.5's
YaRN, linear, dynamic, longrope) runs with every fast path pinned on and pinned off: the C++ decode stack
takes its cos/sin from the model's Rotary, so the recipe must hold there too. Dynamic and longrope
generate past their switch position (16) from prompts inside it, where transformers' cached generation is
the reference (services/decoder/model/rope.py); small prefill chunks and preemption then prove that a
token's rotation depends on its position only, not on the chunk it was computed in.
"""
from __future__ import annotations

import pytest

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams
from services.decoder.runner.runner import Runner
from tests.decoder.drive import drive, token_ids
from tests.decoder.model.checkpoints import ROPE_CASES, build, greedy_reference
from tests.decoder.runner.test_runner import PLANS

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Shorter than 16, the switch position of the dynamic and longrope checkpoints (see test_rope.py for why the
# reference needs prompts inside it).
PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [40, 41], list(range(100, 115)), [7] * 13, [99, 3, 150, 12, 64]]


# The recipes whose frequencies change with the position (services/decoder/model/rope.py).
POSITIONAL = [name for name, (_, overrides, _) in ROPE_CASES.items()
              if overrides["rope_parameters"]["rope_type"] in ("dynamic", "longrope")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (folder, transformers' greedy tokens), each checkpoint written and generated once."""
    cache = {}

    def get(name):
        if name not in cache:
            folder = build(tmp_path_factory.mktemp("rope"), name, seed=70)
            cache[name] = folder, greedy_reference(folder, PROMPTS, GREEDY.max_tokens)
        return cache[name]
    return get


def run_engine(folder, plan: str, *, num_blocks=256, budget=512, prefix_caching=True):
    runner = Runner.from_folder(folder, "fp32", 4, num_blocks, fast_paths=PLANS[plan])
    fused_steps = []
    if runner.fused_decode is not None:
        run = runner.fused_decode._run
        runner.fused_decode._run = lambda *a: fused_steps.append(1) or run(*a)
    core = EngineCore(runner, EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                           max_num_seqs=8, max_model_len=64, enable_prefix_caching=prefix_caching))
    tokens = drive(core, PROMPTS, GREEDY, stagger=0)
    return token_ids(tokens, len(PROMPTS)), core.stats(), len(fused_steps)


@pytest.mark.parametrize("plan", ["fast", "reference"])
@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_greedy_equals_transformers_with_fast_paths_pinned(built, name, plan):
    folder, expected = built(name)
    got, _, fused_steps = run_engine(folder, plan)
    assert got == expected
    assert (fused_steps > 0) == (plan == "fast")       # the decode stack ran the recipe's decode steps


@pytest.mark.parametrize("name", POSITIONAL)
def test_small_chunks_and_preemption_equal_transformers(built, name):
    folder, expected = built(name)
    assert max(map(len, PROMPTS)) < 16 < max(map(len, PROMPTS)) + GREEDY.max_tokens   # across the switch
    got, _, _ = run_engine(folder, "fast", budget=5)
    assert got == expected
    got, stats, _ = run_engine(folder, "fast", num_blocks=14, budget=16, prefix_caching=False)
    assert stats.num_preemptions > 0
    assert got == expected
