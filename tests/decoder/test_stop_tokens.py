"""min_tokens and stop_token_ids through the real engine (core + runner + sampler) on a tiny checkpoint.

logit_bias +100 makes one token the greedy choice at every step, so the stop rules are what decides
each output: EOS or a stop token ends a choice at once, unless min_tokens blocks it until that many
other tokens were generated. Chunked prefill and a KV pool small enough to preempt run alongside.
"""
from __future__ import annotations

import pytest

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SampledToken, SamplingParams, StepOutput
from services.decoder.runner.runner import Runner
from tests.decoder.model.checkpoints import build

EOS, OTHER = 2, 77
PROMPT = [5, 9, 14, 3, 77, 21, 8, 40, 41]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build(tmp_path_factory.mktemp("stops"), "llama_gqa4_tied_sharded")


def run(folder, jobs: dict[str, SamplingParams], num_blocks=64, budget=64):
    """({request id: (tokens, finish reason, stop token id)}, engine stats) once every job ended."""
    runner = Runner.from_folder(folder, "fp32", 4, num_blocks, fast_paths="screen=on")
    core = EngineCore(runner, EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget,
                                           max_num_seqs=8, max_model_len=64, eos_token_ids=(EOS,)))
    for rid, params in jobs.items():
        core.add_request(rid, PROMPT, params)
    got = {rid: [[], None, None] for rid in jobs}
    for _ in range(2000):
        if not core.has_unfinished():
            break
        for out in core.step():
            got[out.request_id][0].extend(out.new_token_ids)
            if out.finished:
                got[out.request_id][1:] = [out.finish_reason, out.stop_token_id]
    core.check_idle()
    return {rid: tuple(v) for rid, v in got.items()}, core.stats()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 12), **kw)


def test_min_tokens_blocks_eos_and_stop_token_ids(folder):
    got, _ = run(folder, {
        "eos": greedy(logit_bias=((EOS, 100.0),)),
        "eos-min5": greedy(logit_bias=((EOS, 100.0),), min_tokens=5),
        "stop-id": greedy(logit_bias=((OTHER, 100.0),), stop_token_ids=(OTHER,)),
        "stop-id-min3": greedy(logit_bias=((OTHER, 100.0),), stop_token_ids=(OTHER,), min_tokens=3),
        # ignore_eos: EOS is an ordinary token, so min_tokens has nothing to block.
        "ignore-eos": greedy(logit_bias=((EOS, 100.0),), ignore_eos=True, min_tokens=3, max_tokens=6),
        "sampled-min4": SamplingParams(temperature=1.0, seed=7, max_tokens=12, logit_bias=((EOS, 100.0),),
                                       min_tokens=4),
    })
    assert got["eos"] == ([EOS], "stop", EOS)
    tokens, reason, stop = got["eos-min5"]
    assert len(tokens) == 6 and EOS not in tokens[:5] and (tokens[5], reason, stop) == (EOS, "stop", EOS)
    assert got["stop-id"] == ([OTHER], "stop", OTHER)
    tokens, reason, stop = got["stop-id-min3"]
    assert len(tokens) == 4 and OTHER not in tokens[:3] and (tokens[3], reason, stop) == (OTHER, "stop", OTHER)
    assert got["ignore-eos"] == ([EOS] * 6, "length", None)
    tokens, reason, _ = got["sampled-min4"]
    assert len(tokens) == 5 and EOS not in tokens[:4] and tokens[4] == EOS and reason == "stop"


def test_min_tokens_holds_through_chunked_prefill_and_preemption(folder):
    jobs = {f"r{i}": greedy(logit_bias=((EOS, 100.0),), min_tokens=4 + i, max_tokens=20) for i in range(4)}
    whole, _ = run(folder, jobs)
    squeezed, stats = run(folder, jobs, num_blocks=7, budget=5)    # prefill in chunks of <= 5
    assert stats.num_preemptions > 0 and squeezed == whole
    for i in range(4):
        tokens, reason, _ = whole[f"r{i}"]
        assert len(tokens) == 5 + i and EOS not in tokens[:-1] and reason == "stop"


class AlwaysRunner:
    """Answers `token` for every sampled chunk, ignoring blocked_token_ids (a runner off-contract),
    and records what the engine blocked."""

    def __init__(self, token: int):
        self.token = token
        self.blocked: list[tuple[int, tuple[int, ...]]] = []

    def execute(self, step):
        sampled = {}
        for c in step.chunks:
            if c.sample:
                self.blocked.append((len(c.output_token_ids), c.blocked_token_ids))
                sampled[c.request_id] = SampledToken(self.token)
        return StepOutput(sampled)


def test_the_engine_names_the_stop_ids_and_obeys_min_tokens_itself():
    runner = AlwaysRunner(EOS)
    core = EngineCore(runner, EngineConfig(block_size=4, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                                           max_model_len=64, eos_token_ids=(EOS, 3)))
    core.add_request("a", PROMPT, greedy(min_tokens=3, stop_token_ids=(OTHER, EOS)))
    outs = []
    while core.has_unfinished():
        outs.extend(core.step())
    assert [t for o in outs for t in o.new_token_ids] == [EOS] * 4 and outs[-1].finish_reason == "stop"
    # EOS ids first, then stop_token_ids, each once; nothing blocked once min_tokens outputs exist.
    assert runner.blocked == [(0, (EOS, 3, OTHER)), (1, (EOS, 3, OTHER)), (2, (EOS, 3, OTHER)), (3, ())]
    core.check_idle()
