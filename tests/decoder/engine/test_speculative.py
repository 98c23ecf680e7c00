"""Speculative decoding in the engine core (no model): drafting, verification bookkeeping,
rollback of rejected drafts' blocks, caps and the batch-size switch, against the FakeRunner,
which verifies drafts by reading every context back from its fake KV cache."""
import pytest

from services.decoder.engine.config import EngineConfig, SpeculativeConfig
from services.decoder.engine.drafter import NgramDrafter
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.kv_cache_manager import cdiv
from services.decoder.engine.request import Request
from services.decoder.engine.scheduler import Scheduler
from services.decoder.engine.step import SampledToken, SamplingParams, StepOutput

from .fakes import EOS, FakeRunner, Job, drive, ngram_token

# A prompt whose continuation under ngram_token falls into cycles the drafter can predict.
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


def _spec(k=4, lookup_max=3, lookup_min=1, off_at=8):
    return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min,
                             disable_by_batch_size=off_at)


def _core(speculative=None, **cfg):
    cfg.setdefault("block_size", 4)
    cfg.setdefault("num_blocks", 64)
    cfg.setdefault("max_num_batched_tokens", 64)
    cfg.setdefault("max_model_len", 128)
    config = EngineConfig(speculative=speculative, eos_token_ids=(EOS,), **cfg)
    runner = FakeRunner(config, rule=ngram_token)
    return EngineCore(runner, config), runner


# -- the drafter ----------------------------------------------------------------------------------

def test_drafter_proposes_what_followed_the_most_recent_longest_match():
    d = NgramDrafter(max_n=3, min_n=1)
    assert d.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    # [7, 1, 2] occurs once, earlier than the more recent [1, 2]: the longer n-gram wins.
    assert d.propose([7, 1, 2, 8, 9, 1, 2, 5, 7, 1, 2], 2) == [8, 9]
    # Of two occurrences of the same n-gram, the most recent one is followed.
    assert d.propose([4, 4, 1, 6, 4, 4, 1, 7, 4, 4], 2) == [1, 7]
    assert d.propose([5, 5, 5], 4) == [5]              # the match may overlap the suffix
    assert d.propose([1, 2, 3], 4) == []               # nothing repeats
    assert d.propose([1, 2, 1, 2], 0) == []


def test_drafter_respects_min_n_and_cuts_before_a_stop_token():
    assert NgramDrafter(max_n=3, min_n=2).propose([1, 9, 8, 1], 3) == []      # only a 1-gram repeats
    assert NgramDrafter(max_n=3, min_n=1).propose([1, 9, 8, 1], 3) == [9, 8, 1]
    assert NgramDrafter(3, 1).propose([1, 9, 0, 8, 1], 3, frozenset({0})) == [9]
    assert NgramDrafter(3, 1).propose([1, 0, 8, 1], 3, frozenset({0})) == []


# -- the configuration ----------------------------------------------------------------------------

def test_config_follows_vllm_defaults():
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("text, message", [
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
    ('{"num_speculative_tokens": 2}', 'needs "method"'),
    ('{"method": "ngram"}', 'needs "num_speculative_tokens"'),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown keys ['model']"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
    ("ngram", "not JSON"),
    ("[1]", "must be a JSON object"),
])
def test_config_refuses_bad_values(text, message):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_json(text)
    assert message in str(info.value)


# -- through the core -----------------------------------------------------------------------------

def test_outputs_equal_speculation_off_with_fewer_steps_and_drafts_both_accepted_and_rejected():
    jobs = [Job("a", PROMPT, max_tokens=40, ignore_eos=True), Job("b", PROMPT[::-1], max_tokens=33, salt=1)]
    core_off, runner_off = _core()
    off = drive(core_off, runner_off, jobs, timed=False)
    core_on, runner_on = _core(_spec())
    on = drive(core_on, runner_on, jobs, timed=False)
    assert runner_on.violations == [] and runner_off.violations == []
    assert on.tokens == off.tokens and on.reasons == off.reasons
    stats = core_on.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_verifications > 0 and 0 < stats.acceptance_rate < 1
    assert on.steps < off.steps
    core_on.check_idle()


def test_rejected_drafts_leave_no_blocks_and_only_accepted_tokens_reach_the_prefix_cache():
    core, runner = _core(_spec(), block_size=2)
    core.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                     extra_keys=(("salt", 0),))     # as drive() adds them
    runner.register("a", PROMPT)
    req = core.scheduler.requests["a"]
    rejected_somewhere = False
    while core.has_unfinished():
        before = core.scheduler.num_draft_tokens - core.scheduler.num_accepted_tokens
        core.step()
        rejected_somewhere |= core.scheduler.num_draft_tokens - core.scheduler.num_accepted_tokens > before
        if not req.is_finished:
            # Blocks for the computed positions only: none left over from a rejected draft.
            assert len(req.block_ids) == cdiv(req.num_computed_tokens, 2)
            assert req.num_computed_tokens == req.num_tokens - 1
    assert rejected_somewhere and runner.violations == []
    core.check_idle()
    # A second request continuing the first's text hits blocks holding its accepted outputs; the fake
    # checks every position it reads back, so a block registered with a rejected draft's KV fails here.
    text = list(PROMPT) + list(req.output_token_ids)
    res = drive(core, runner, [Job("b", text, max_tokens=4, ignore_eos=True)])
    assert res.cached[("b", 0)] == (len(text) - 1) // 2 * 2 and runner.violations == []
    core.check_idle()


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_a_run_never_passes_max_tokens(max_tokens):
    core, runner = _core(_spec(k=6))
    res = drive(core, runner, [Job("a", PROMPT * 2, max_tokens=max_tokens, ignore_eos=True)])
    assert len(res.tokens[("a", 0)]) == max_tokens and res.reasons[("a", 0)] == "length"
    for step in runner.steps:
        for c in step.chunks:
            assert len(c.output_token_ids) + len(c.draft_token_ids) + 1 <= max_tokens
    core.check_idle()


def test_a_run_stops_at_a_stop_token():
    jobs = [Job("a", PROMPT * 2, max_tokens=60, stop_token_ids=(9,), ignore_eos=True),
            Job("b", PROMPT, max_tokens=60, stop_token_ids=(1,), ignore_eos=True)]
    core_off, runner_off = _core()
    off = drive(core_off, runner_off, jobs, timed=False)
    core, runner = _core(_spec())
    on = drive(core, runner, jobs, timed=False)
    assert on.tokens == off.tokens and on.reasons == off.reasons
    assert core.stats().num_accepted_tokens > 0
    for step in runner.steps:
        for c in step.chunks:
            assert c.sampling.stop_token_ids[0] not in c.draft_token_ids
    core.check_idle()


def test_drafts_stay_inside_the_min_tokens_regime():
    core, runner = _core(_spec(k=4))
    drive(core, runner, [Job("a", PROMPT * 2, max_tokens=20)], timed=False)
    core2, runner2 = _core(_spec(k=4))
    core2.add_request("m", PROMPT * 2, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6))
    runner2.register("m", PROMPT * 2)
    while core2.has_unfinished():
        core2.step()
    for step in runner2.steps:
        for c in step.chunks:
            outs = len(c.output_token_ids)
            if outs < 6:
                assert outs + len(c.draft_token_ids) < 6 and c.blocked_token_ids
    core2.check_idle()


def test_drafting_turns_off_at_the_batch_size():
    core, runner = _core(_spec(off_at=2))
    jobs = [Job(f"r{i}", PROMPT, max_tokens=m, ignore_eos=True) for i, m in enumerate([4, 8, 30])]
    drive(core, runner, jobs, timed=False)
    for step in runner.steps:
        if len(step.chunks) >= 2:
            assert all(not c.draft_token_ids for c in step.chunks)
    assert any(c.draft_token_ids for step in runner.steps for c in step.chunks)   # the last one alone drafts
    core.check_idle()


def test_drafts_give_way_before_anyone_is_preempted():
    # 7 blocks of 2: both requests fit without drafts; drafts would need more.
    jobs = [Job("a", PROMPT[:5], max_tokens=4, ignore_eos=True), Job("b", PROMPT[5:10], max_tokens=4, ignore_eos=True)]
    core, runner = _core(_spec(k=4, off_at=8), block_size=2, num_blocks=8)
    res = drive(core, runner, jobs, timed=False)
    core_off, runner_off = _core(block_size=2, num_blocks=8)
    off = drive(core_off, runner_off, jobs, timed=False)
    assert res.tokens == off.tokens and runner.violations == []
    assert core.stats().num_preemptions == core_off.stats().num_preemptions
    core.check_idle()


def test_a_runner_accepting_something_else_than_a_draft_prefix_is_refused():
    config = EngineConfig(block_size=4, num_blocks=16, speculative=_spec())
    sched = Scheduler(config)
    prompt = [1, 2, 3, 1, 2]
    req = Request("a", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), arrival_seq=0)
    sched.add(req)
    runner = FakeRunner(config, rule=ngram_token)
    runner.register("a", prompt)
    plan, _ = sched.schedule()
    sched.update(plan, runner.execute(plan.step))               # the prefill
    plan, _ = sched.schedule()
    (chunk,) = plan.step.chunks
    first = chunk.draft_token_ids[0]
    with pytest.raises(ValueError, match="not a prefix of its drafts"):
        sched.check_step_output(plan, StepOutput({"a": SampledToken(1)}, {"a": [SampledToken(first + 1)]}))
    sched.check_step_output(plan, StepOutput({"a": SampledToken(1)}, {"a": [SampledToken(first)]}))
