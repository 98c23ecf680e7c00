"""The real engine (core + runner) against transformers' greedy generate.

Staggered arrivals, prefill chunks that cut every prompt, and a KV pool small
enough to force preemption must all give exactly the unconstrained tokens.
"""
from __future__ import annotations

import pytest

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams
from services.decoder.runner.runner import Runner
from tests.decoder.drive import drive, token_ids
from tests.decoder.model.checkpoints import build, greedy_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [40, 41], list(range(10, 33)), [7] * 13, [99, 3, 150, 12, 64]]


@pytest.fixture(scope="module", params=["llama_gqa4_tied_sharded", "qwen3_odd3_gqa3_qknorm"])
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp("gen"), request.param)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return greedy_reference(checkpoint, PROMPTS, GREEDY.max_tokens)


def run_engine(folder, *, num_blocks, budget, stagger, block_size=4, prefix_caching=True):
    runner = Runner.from_folder(folder, "fp32", block_size, num_blocks, fast_paths="screen=on")
    core = EngineCore(runner, EngineConfig(block_size=block_size, num_blocks=num_blocks,
                                           max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=64,
                                           enable_prefix_caching=prefix_caching))
    return token_ids(drive(core, PROMPTS, GREEDY, stagger=stagger), len(PROMPTS)), core.stats()


def test_unconstrained_equals_transformers(checkpoint, expected):
    got, _ = run_engine(checkpoint, num_blocks=256, budget=512, stagger=1)
    assert got == expected


def test_staggered_small_chunks_equal_transformers(checkpoint, expected):
    got, _ = run_engine(checkpoint, num_blocks=256, budget=5, stagger=3)
    assert got == expected


def test_preemption_equals_transformers(checkpoint, expected):
    got, stats = run_engine(checkpoint, num_blocks=12, budget=16, stagger=1, prefix_caching=False)
    assert stats.num_preemptions > 0
    assert got == expected


def test_prefix_hit_same_output_and_cached_tokens(checkpoint, expected):
    runner = Runner.from_folder(checkpoint, "fp32", 4, 64, fast_paths="screen=on")
    core = EngineCore(runner, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64,
                                           max_model_len=64))
    prompt = PROMPTS[2]
    results = []
    for rid in ("a", "b"):
        core.add_request(rid, prompt, GREEDY)
        toks, cached = [], 0
        while core.has_unfinished():
            for out in core.step():
                toks.extend(out.new_token_ids)
                cached = out.num_cached_tokens
        results.append((toks, cached))
    assert results[0] == (expected[2], 0)
    assert results[1][0] == expected[2]
    assert results[1][1] == 20   # 5 full blocks of 4; the 23rd token is always computed
    core.check_idle()
