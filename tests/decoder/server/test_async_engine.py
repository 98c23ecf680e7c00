"""AsyncEngine over a FakeRunner: abort_all, the fault hook, and a refused request that leaves it serving."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import Unavailable
from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams
from services.decoder.server.async_engine import AsyncEngine
from tests.decoder.engine.fakes import VOCAB, CountingLeases, FakeRunner, RefusingRunner, next_token


def _expected(prompt, max_tokens):
    """The fake's greedy continuation (ignore_eos)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, 0, None))
    return tokens[len(prompt):]


LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def engine_for(runner_class=FakeRunner):
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16, max_model_len=128)
    runner = runner_class(config)
    leases = CountingLeases()
    core = EngineCore(runner, config, leases)
    return AsyncEngine(core), core, runner, leases


async def collect(engine, rid, prompt, sampling):
    outs = [o async for o in engine.generate(rid, prompt, sampling)]
    return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason


class SlowRunner(FakeRunner):
    """Takes a few milliseconds a step, so that requests are still running when the test acts."""

    def execute(self, step):
        time.sleep(0.005)
        return super().execute(step)


def test_abort_all_ends_every_stream_and_the_engine_serves_on():
    engine, core, runner, leases = engine_for(SlowRunner)
    for rid in ("a", "b", "next"):
        runner.register(rid, [1, 2, 3])

    async def scenario():
        engine.start()
        try:
            streams = [engine.generate(rid, [1, 2, 3], LONG) for rid in ("a", "b")]
            for stream in streams:                      # both admitted: each has its first token
                assert (await anext(stream)).new_token_ids
            aborted = await engine.abort_all()
            ended = [[o async for o in stream][-1].finish_reason for stream in streams]
            return aborted, ended, await collect(engine, "next", [1, 2, 3], SHORT)
        finally:
            engine.stop()
    aborted, ended, after = asyncio.run(scenario())
    assert aborted == 2 and ended == ["abort", "abort"]
    assert after == (_expected([1, 2, 3], 3), "length") and engine.failed is None
    assert leases.acquires == leases.releases == 3 and not leases.violations and runner.violations == []
    core.check_idle()


def test_the_fault_hook_kills_the_engine_and_returns_everything():
    engine, core, runner, leases = engine_for()
    runner.register("a", [1, 2, 3])
    engine.inject_fault(3)
    failures = []
    engine.on_failure = failures.append

    async def scenario():
        engine.start()
        try:
            # The failed step's own request hears its error (dispatched before the engine's failure).
            tokens, reason = await collect(engine, "a", [1, 2, 3], LONG)
            assert reason == "error" and tokens == _expected([1, 2, 3], 2)      # steps 1 and 2 ran
            while engine.alive:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)                 # on_failure runs on this loop
            with pytest.raises(Unavailable, match="injected fault at engine step 3"):
                await collect(engine, "b", [1], SHORT)
        finally:
            engine.stop()
    asyncio.run(scenario())
    assert failures and "injected fault at engine step 3" in failures[0]
    assert leases.acquires == leases.releases == 1
    core.check_idle()


def test_a_refused_request_fails_alone_and_the_engine_stays_up():
    engine, core, runner, leases = engine_for(RefusingRunner)
    for rid in ("good", "bad", "next"):
        runner.register(rid, [1, 2, 3])

    async def scenario():
        engine.start()
        try:
            together = await asyncio.gather(collect(engine, "good", [1, 2, 3], SHORT),
                                            collect(engine, "bad", [1, VOCAB, 3], SHORT))
            return together, engine.alive, await collect(engine, "next", [1, 2, 3], SHORT)
        finally:
            engine.stop()
    together, alive, after = asyncio.run(scenario())
    assert alive and engine.failed is None
    assert together == [(_expected([1, 2, 3], 3), "length"), ([], "error")]
    assert after == (_expected([1, 2, 3], 3), "length")
    assert leases.acquires == leases.releases == 3 and not leases.violations
    core.check_idle()
