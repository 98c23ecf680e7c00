"""Random workloads through the engine core: every allocation is returned, and
every choice that finished normally says exactly what an unconstrained run says,
with speculative decoding on or off (drafts accepted and rejected at random
places, mixed with aborts, preemptions and failed steps)."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.decoder.engine.config import EngineConfig, SpeculativeConfig
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.kv_cache_manager import cdiv

from .fakes import EOS, CountingLeases, FakeRunner, Job, drive, ngram_token

TOKENS = st.integers(1, 12)


@st.composite
def speculative_configs(draw):
    lookup_max = draw(st.integers(1, 3))
    return SpeculativeConfig(num_speculative_tokens=draw(st.integers(1, 4)), prompt_lookup_max=lookup_max,
                             prompt_lookup_min=draw(st.integers(1, lookup_max)),
                             disable_by_batch_size=draw(st.integers(2, 6)))


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    prefixes = [draw(st.lists(TOKENS, min_size=2, max_size=10)) for _ in range(2)]
    jobs = []
    for k in range(draw(st.integers(1, 6))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(TOKENS, min_size=1, max_size=6))
        jobs.append(Job(
            f"r{k}", prompt, max_tokens=draw(st.integers(1, 6)), n=draw(st.sampled_from([1, 1, 1, 2, 3])),
            arrival_step=draw(st.sampled_from([0, 0, 2, 5, 9])),
            abort_step=draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 10))),
            salt=draw(st.integers(0, 1)), stop_token_ids=draw(st.sampled_from([(), (5,)])),
            ignore_eos=draw(st.booleans()), seed=draw(st.one_of(st.none(), st.integers(0, 3)))))
    need = max(cdiv(len(j.prompt) + j.max_tokens - 1, block_size) for j in jobs)
    config = EngineConfig(
        block_size=block_size, num_blocks=need + draw(st.sampled_from([0, 0, 1, 2, 8])),
        max_num_batched_tokens=draw(st.integers(1, 12)), max_num_seqs=draw(st.integers(2, 5)),
        max_model_len=64, enable_prefix_caching=draw(st.sampled_from([True, True, False])), eos_token_ids=(EOS,))
    fail_calls = draw(st.sampled_from([frozenset(), frozenset()]) | st.frozensets(st.integers(0, 15), max_size=2))
    lease_capacity = draw(st.one_of(st.none(), st.integers(1, 3)))
    return config, jobs, fail_calls, lease_capacity


def _reference(jobs):
    """Big pool, big budget, no prefix cache, everything at once, no aborts, no failures."""
    config = EngineConfig(block_size=4, num_blocks=1024, max_num_batched_tokens=4096, max_num_seqs=256,
                          max_model_len=64, enable_prefix_caching=False, eos_token_ids=(EOS,))
    runner = FakeRunner(config, rule=ngram_token)
    res = drive(EngineCore(runner, config), runner, jobs, timed=False)
    assert runner.violations == []
    return res


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_return_everything_and_match_the_unconstrained_run(workload):
    config, jobs, fail_calls, lease_capacity = workload
    leases = CountingLeases(lease_capacity)
    runner = FakeRunner(config, fail_calls, rule=ngram_token)
    core = EngineCore(runner, config, leases)
    res = drive(core, runner, jobs)
    ref = _reference(jobs)

    assert runner.violations == [] and leases.violations == []
    core.check_idle()
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == config.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert leases.active == set() and leases.acquires == leases.releases

    assert set(res.reasons) == set(ref.reasons) == set(res.tokens)
    for key, reason in res.reasons.items():
        if reason in ("stop", "length"):
            assert res.tokens[key] == ref.tokens[key] and reason == ref.reasons[key], key
        else:
            assert reason in ("abort", "error")
            assert ref.tokens[key][:len(res.tokens[key])] == res.tokens[key], key
    if not fail_calls:
        assert "error" not in res.reasons.values()
