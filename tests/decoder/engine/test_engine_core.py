import os
import subprocess
import sys

import pytest

from services.common.errors import AdapterNotFound, ContextLengthExceeded, InvalidArgument
from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.step import SamplingParams, StepOutput

from .fakes import VOCAB, CountingLeases, FakeRunner, Job, RefusingRunner, drive, next_token

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _core(leases=None, fail_calls=frozenset(), **cfg):
    cfg.setdefault("block_size", 4)
    cfg.setdefault("num_blocks", 64)
    cfg.setdefault("max_num_batched_tokens", 64)
    cfg.setdefault("max_model_len", 128)
    config = EngineConfig(**cfg)
    runner = FakeRunner(config, fail_calls)
    return EngineCore(runner, config, leases), runner


def _expected(prompt, max_tokens, salt=0, seed=None):
    """Greedy continuation straight from the fake's token function (ignore_eos)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, salt, seed))
    return tokens[len(prompt):]


def test_engine_core_imports_no_torch():
    # Nor the grammar library: a grammar reaches the engine only as an opaque feature of a request.
    code = ("import sys, services.decoder.engine.engine_core, services.decoder.engine.scheduler;"
            "print('torch' in sys.modules, 'xgrammar' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False False"


def test_generation_follows_the_context_through_chunks():
    core, runner = _core(max_num_batched_tokens=3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    res = drive(core, runner, [Job("a", prompt, max_tokens=6, ignore_eos=True)])
    assert res.tokens[("a", 0)] == _expected(prompt, 6)
    assert res.reasons[("a", 0)] == "length"
    assert runner.violations == []
    core.check_idle()


def test_prefix_hit_reports_cached_tokens_and_keeps_the_output():
    core, runner = _core()
    prompt = list(range(1, 12))                      # 11 tokens: two full blocks of 4 can hit
    first = drive(core, runner, [Job("a", prompt, max_tokens=3, ignore_eos=True)])
    again = drive(core, runner, [Job("b", prompt, max_tokens=3, ignore_eos=True)])
    assert first.cached[("a", 0)] == 0 and again.cached[("b", 0)] == 8
    assert again.tokens[("b", 0)] == first.tokens[("a", 0)] == _expected(prompt, 3)
    stats = core.stats()
    assert stats.prefix_queries == 22 and stats.prefix_hits == 8
    assert stats.num_free_blocks == stats.num_total_blocks
    assert runner.violations == []
    core.check_idle()


def test_different_extra_keys_never_share_blocks():
    core, runner = _core()
    prompt = list(range(1, 12))
    a = drive(core, runner, [Job("a", prompt, max_tokens=2, salt=1, ignore_eos=True)])
    b = drive(core, runner, [Job("b", prompt, max_tokens=2, salt=2, ignore_eos=True)])
    assert b.cached[("b", 0)] == 0
    assert a.tokens[("a", 0)] == _expected(prompt, 2, salt=1)
    assert b.tokens[("b", 0)] == _expected(prompt, 2, salt=2)
    assert runner.violations == []


SHARED = [7, 3, 5, 2, 9, 4, 8, 6]                    # two full blocks of 4


def _starts(runner, step):
    """{request id: its chunk's first position} in the runner's step-th step."""
    return {c.request_id: c.start for c in runner.steps[step].chunks}


def test_a_request_waits_one_step_for_the_blocks_another_is_computing_and_hits_them():
    # Three prompts arrive together; b shares a's first two blocks, c shares nothing. b waits for a's blocks
    # instead of computing them again in the same forward; c is not held up behind it.
    core, runner = _core()
    jobs = [Job("a", SHARED + [1, 2], max_tokens=3, ignore_eos=True),
            Job("b", SHARED + [5, 5, 1], max_tokens=3, ignore_eos=True),
            Job("c", [2, 4, 6, 8, 1, 3], max_tokens=3, ignore_eos=True)]
    res = drive(core, runner, jobs)
    assert _starts(runner, 0) == {"a": 0, "c": 0}
    assert _starts(runner, 1)["b"] == len(SHARED)
    assert res.cached == {("a", 0): 0, ("b", 0): len(SHARED), ("c", 0): 0}
    for job in jobs:
        assert res.tokens[(job.request_id, 0)] == _expected(job.prompt, 3)
    assert runner.violations == []
    core.check_idle()


def test_a_waiting_request_computes_the_blocks_itself_once_their_owner_is_gone():
    # a's prompt takes three steps at 4 tokens a step; b waits behind it until a is aborted after its first
    # block, then hits that block and computes the second itself.
    core, runner = _core(max_num_batched_tokens=4)
    jobs = [Job("a", SHARED + [1, 2], max_tokens=3, ignore_eos=True, abort_step=1),
            Job("b", SHARED + [5, 5, 1], max_tokens=3, ignore_eos=True)]
    res = drive(core, runner, jobs)
    assert _starts(runner, 0) == {"a": 0}
    assert _starts(runner, 1) == {"b": 4}
    assert res.reasons[("a", 0)] == "abort" and res.cached[("b", 0)] == 4
    assert res.tokens[("b", 0)] == _expected(jobs[1].prompt, 3)
    assert runner.violations == []
    core.check_idle()


def test_a_request_does_not_wait_for_a_shared_block_much_shorter_than_its_own_tokens():
    # b shares a's first block (4 tokens) but has 9 more of its own: a step's wait is not worth 4 tokens.
    core, runner = _core()
    jobs = [Job("a", SHARED[:4] + [1, 2, 3], max_tokens=2, ignore_eos=True),
            Job("b", SHARED[:4] + [9, 8, 7, 6, 5, 4, 3, 2, 1], max_tokens=2, ignore_eos=True)]
    res = drive(core, runner, jobs)
    assert _starts(runner, 0) == {"a": 0, "b": 0}
    assert res.tokens[("b", 0)] == _expected(jobs[1].prompt, 2)
    core.check_idle()


def test_without_prefix_caching_nobody_waits_for_shared_blocks():
    core, runner = _core(enable_prefix_caching=False)
    jobs = [Job("a", SHARED + [1, 2], max_tokens=2, ignore_eos=True),
            Job("b", SHARED + [5, 5, 1], max_tokens=2, ignore_eos=True)]
    res = drive(core, runner, jobs)
    assert _starts(runner, 0) == {"a": 0, "b": 0}
    assert res.cached == {("a", 0): 0, ("b", 0): 0}
    core.check_idle()


def test_n_choices_share_prompt_blocks_and_each_hold_a_lease():
    leases = CountingLeases()
    core, runner = _core(leases)
    prompt = list(range(1, 14))                      # 3 full blocks of 4
    runner.register("p", prompt, n=3)
    core.add_request("p", prompt, SamplingParams(max_tokens=4, n=3, seed=10, ignore_eos=True))
    shared_seen = False
    tokens = {i: [] for i in range(3)}
    while core.has_unfinished():
        outs = core.step()
        for out in outs:
            tokens[out.index] += out.new_token_ids
        tables = [c.block_table for c in runner.steps[-1].chunks]
        if len(tables) == 3 and not any(o.finished for o in outs):
            assert tables[0][:3] == tables[1][:3] == tables[2][:3]
            assert all(core.scheduler.kv.pool.blocks[b].ref_cnt == 3 for b in tables[0][:3])
            shared_seen = True
    assert shared_seen
    for i in range(3):
        assert tokens[i] == _expected(prompt, 4, seed=10 + i)
    assert leases.acquires == leases.releases == 3 and not leases.violations
    assert runner.violations == []
    core.check_idle()


def test_runner_failure_fails_only_that_step_and_the_core_keeps_serving():
    core, runner = _core(fail_calls=frozenset({1}), max_num_batched_tokens=4)
    leases = CountingLeases()
    core.scheduler.leases = leases
    jobs = [Job("a", [1, 2, 3], max_tokens=3, ignore_eos=True),
            Job("late", [4, 5], max_tokens=2, ignore_eos=True, arrival_step=3)]
    res = drive(core, runner, jobs)
    assert res.reasons[("a", 0)] == "error"
    assert res.reasons[("late", 0)] == "length" and res.tokens[("late", 0)] == _expected([4, 5], 2)
    assert "a" in runner.steps[2].finished_request_ids     # the runner is told to drop it
    assert leases.active == set() and not leases.violations
    assert runner.violations == []
    core.check_idle()


def test_abort_and_finish_from_above_emit_final_outputs():
    core, runner = _core()
    for rid in ("a", "b"):
        runner.register(rid, [1, 2], n=2 if rid == "b" else 1)
    core.add_request("a", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True))
    core.add_request("b", [1, 2], SamplingParams(max_tokens=50, n=2, ignore_eos=True))
    core.step()
    assert core.abort("a") and not core.abort("a") and not core.abort("unknown")
    assert core.finish("b", index=1)
    assert not core.finish("b", index=5)
    outs = core.step()
    final = {(o.request_id, o.index): o.finish_reason for o in outs if o.finished}
    assert final == {("a", 0): "abort", ("b", 1): "stop"}
    core.abort("b")
    core.step()
    assert not core.has_unfinished()
    core.check_idle()


def test_bad_requests_are_refused_with_nothing_queued():
    core, _ = _core(max_model_len=16)
    with pytest.raises(ContextLengthExceeded):
        core.add_request("long", list(range(1, 18)), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidArgument):
        core.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidArgument):
        core.add_request("n0", [1], SamplingParams(n=0))
    core.add_request("x", [1], SamplingParams(max_tokens=1))
    told, _ = _core(vocab_size=VOCAB)           # an engine told the vocabulary refuses ids past it
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        told.add_request("oov", [1, VOCAB], SamplingParams(max_tokens=1))
    assert not told.has_unfinished()
    with pytest.raises(InvalidArgument, match="duplicate"):
        core.add_request("x", [1], SamplingParams(max_tokens=1))
    stats = core.stats()
    assert stats.num_waiting == 1 and stats.num_running == 0


def test_lease_hook_error_fails_the_request_cleanly():
    class Refusing(CountingLeases):
        def acquire(self, request):
            raise AdapterNotFound("adapter 'x' was unloaded")

    core, runner = _core(Refusing())
    res = drive(core, runner, [Job("a", [1, 2, 3], max_tokens=2)])
    assert res.reasons[("a", 0)] == "error"
    core.check_idle()


def test_a_request_the_runner_refuses_fails_alone_and_the_core_keeps_serving():
    """Requests past validation (the engine was not told the vocabulary) with an id the runner refuses:
    in a first prefill chunk, and in a later one after a chunk that ran. Only they fail; the requests
    sharing their steps and the ones after them get their tokens; blocks and leases all come back."""
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=8, max_model_len=128)
    runner = RefusingRunner(config)
    leases = CountingLeases()
    core = EngineCore(runner, config, leases)
    jobs = [Job("a", [1, 2, 3], max_tokens=4, ignore_eos=True),
            Job("bad-first", [1, 2, VOCAB + 7, 4], max_tokens=4, ignore_eos=True),
            Job("bad-later", [1, 2, 3, 4, 5, 6, 7, VOCAB], max_tokens=4, ignore_eos=True),
            Job("b", [4, 5, 6], max_tokens=3, ignore_eos=True),
            Job("late", [4, 5], max_tokens=2, ignore_eos=True, arrival_step=4)]
    errors = []
    real_step = core.step

    def step():
        outputs = real_step()
        assert core.step_error is None          # a refused request is no failed step
        errors.extend(o.error for o in outputs if o.finish_reason == "error")
        return outputs
    core.step = step
    res = drive(core, runner, jobs)
    assert res.reasons[("bad-first", 0)] == res.reasons[("bad-later", 0)] == "error"
    assert res.tokens[("bad-first", 0)] == res.tokens[("bad-later", 0)] == []
    assert len(errors) == 2 and all("token ids must be in" in e for e in errors)
    for job in jobs:
        if not job.request_id.startswith("bad"):
            key = (job.request_id, 0)
            assert res.reasons[key] == "length" and res.tokens[key] == _expected(job.prompt, job.max_tokens)
    # bad-later's first chunk ran (its KV was written) before the chunk holding the bad id was refused.
    assert any(c.request_id == "bad-later" for s in runner.steps for c in s.chunks if c.start == 0)
    assert leases.acquires == leases.releases == len(jobs) and leases.active == set() and not leases.violations
    assert runner.violations == []
    core.check_idle()


def test_a_runner_naming_a_request_outside_its_step_fails_the_step():
    class Confused(FakeRunner):
        def execute(self, step):
            out = super().execute(step)
            return StepOutput(out.sampled, out.accepted, {"ghost": "not in this step"})

    config = EngineConfig(block_size=4, num_blocks=64, max_model_len=128)
    runner = Confused(config)
    core = EngineCore(runner, config)
    runner.register("a", [1, 2])
    core.add_request("a", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    out, = core.step()
    assert out.finish_reason == "error" and "ghost" in out.error and "ghost" in core.step_error
    core.check_idle()
