"""Runner- and engine-level greedy parity that each family's own test file runs over its checkpoints.

test_features.py covers one checkpoint per family; a family's file runs these over each of its checkpoints
(its GQA ratios, ties and options): staggered small chunks with the fast paths pinned on and off, a KV pool
small enough to preempt, n = 2, and a prefix-cache hit. `want` is transformers' greedy continuation of each
prompt (tests/decoder/model/checkpoints.greedy_reference).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams, StepInput
from services.decoder.runner import Runner
from tests.decoder.drive import drive
from tests.decoder.model.checkpoints import TINY_INT8_SHAPE, TINY_SHAPE
from tests.decoder.model.test_quantization import dequantized_reference
from tests.decoder.runner.driver import BlockAllocator, Seq
from tests.tolerance import assert_close

BLOCK = 4


def run_engine(folder, prompts: list[list[int]], greedy: SamplingParams, *, fast_paths: str = "screen=on",
               num_blocks: int = 256, budget: int = 512, stagger: int = 1, prefix_caching: bool = True, n: int = 1,
               on_runner: Callable[[Runner], None] | None = None):
    """Drive an fp32 engine over prompts -> (per prompt, per choice, the generated ids; the engine's stats)."""
    runner = Runner.from_folder(folder, "fp32", BLOCK, num_blocks, fast_paths=fast_paths)
    if on_runner is not None:
        on_runner(runner)
    core = EngineCore(runner, EngineConfig(block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                           max_num_seqs=8, max_model_len=64, enable_prefix_caching=prefix_caching))
    tokens = drive(core, prompts, dataclasses.replace(greedy, n=n), stagger=stagger)
    return [[[t.token_id for t in tokens[(i, c)]] for c in range(n)] for i in range(len(prompts))], core.stats()


def check_chunks_preemption_and_n(folder, prompts, greedy, want, plans: tuple[str, ...]) -> None:
    """Small chunks of staggered arrivals under each plan (its --fast-paths pins), then a pool that preempts,
    then n = 2 greedy choices sharing the prompt's blocks: every answer equals want."""
    for pins in plans:
        got, _ = run_engine(folder, prompts, greedy, budget=5, stagger=3, fast_paths=pins)
        assert [g[0] for g in got] == want, pins
    got, stats = run_engine(folder, prompts, greedy, num_blocks=12, budget=16, prefix_caching=False)
    assert stats.num_preemptions > 0 and [g[0] for g in got] == want
    got, _ = run_engine(folder, prompts, greedy, n=2)
    assert got == [[w, w] for w in want]


def check_prefix_hit(folder, prompt: list[int], greedy: SamplingParams, want: list[int]) -> None:
    """The same prompt twice: the second reads its full blocks from the prefix cache and answers the same."""
    runner = Runner.from_folder(folder, "fp32", BLOCK, 64, fast_paths="screen=on")
    core = EngineCore(runner, EngineConfig(block_size=BLOCK, num_blocks=64, max_num_batched_tokens=64,
                                           max_model_len=64))
    results = []
    for rid in ("a", "b"):
        core.add_request(rid, prompt, greedy)
        toks, cached = [], 0
        while core.has_unfinished():
            for out in core.step():
                toks.extend(out.new_token_ids)
                cached = out.num_cached_tokens
        results.append((toks, cached))
    assert results == [(want, 0), (want, len(prompt) // BLOCK * BLOCK)]
    core.check_idle()


def check_chunks_then_decode(runner: Runner, ref, tokens: list[int]) -> None:
    """The prompt in uneven chunks (one of a single token mid-prompt), then 7 decode steps: each step's logits
    equal ref's (transformers' model) and the greedy tokens equal ref.generate's."""
    alloc, seq = BlockAllocator(64), Seq("a", list(tokens))
    n, out = len(tokens), None
    for size in (5, 1, 9, n - 15):             # uneven, and one 1-token chunk mid-prompt (n > 15)
        out = runner.execute(StepInput([seq.chunk(size, alloc, BLOCK)]))
        assert out.sampled == {} or seq.computed == n
    produced = [out.sampled["a"].token_id]
    seq.tokens.append(produced[-1])
    for _ in range(7):
        logits, _ = runner.logits(StepInput([seq.chunk(1, alloc, BLOCK)]))
        with torch.no_grad():
            want = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], want, **TINY_SHAPE)
        produced.append(int(logits[0].argmax()))
        seq.tokens.append(produced[-1])
    with torch.no_grad():
        expected = ref.generate(torch.tensor([seq.tokens[:n]]), do_sample=False, max_new_tokens=8,
                                pad_token_id=0)[0, n:].tolist()
    assert produced == expected



def check_int8_decode(folder) -> None:
    """int8 weights: a 6-token chunk, then 4 steps, each step's logits equal transformers' model with every
    Linear's weight replaced by what the int8 path computes with."""
    runner = Runner.from_folder(folder, "fp32", block_size=BLOCK, num_blocks=32, quantization="int8")
    assert runner.quantization.startswith("int8: ")
    ref = dequantized_reference(folder)
    alloc, seq = BlockAllocator(32), Seq("a", [7, 9, 11, 13, 40, 41, 42, 100, 101, 150, 5])
    runner.logits(StepInput([seq.chunk(6, alloc, BLOCK)]))
    for _ in range(4):
        logits, _ = runner.logits(StepInput([seq.chunk(len(seq.tokens) - seq.computed, alloc, BLOCK)]))
        with torch.no_grad():
            want = ref(torch.tensor([seq.tokens])).logits[0, -1]
        assert_close(logits[0], want, dtype=torch.int8, **TINY_INT8_SHAPE)
        seq.tokens.append(int(logits[0].argmax()))
