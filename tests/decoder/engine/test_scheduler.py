import pytest

from services.common.errors import ContextLengthExceeded, InvalidArgument
from services.decoder.engine.config import EngineConfig
from services.decoder.engine.request import Request, RequestStatus
from services.decoder.engine.scheduler import Scheduler, validate_request
from services.decoder.engine.step import SampledToken, SamplingParams, StepOutput

from .fakes import CountingLeases, FakeRunner


class Harness:
    """A Scheduler plus a FakeRunner, stepped by hand."""

    def __init__(self, leases=None, **cfg):
        cfg.setdefault("enable_prefix_caching", False)
        self.config = EngineConfig(**cfg)
        self.sched = Scheduler(self.config, leases)
        self.runner = FakeRunner(self.config)
        self.seq = 0

    def add(self, rid, prompt, **sampling):
        sampling.setdefault("ignore_eos", True)
        req = Request(rid, prompt, SamplingParams(**sampling), arrival_seq=self.seq)
        self.seq += 1
        self.runner.register(rid, prompt)
        self.sched.add(req)
        return req

    def step(self, forced=None):
        """Plan, run (or force the sampled token ids), update; returns (plan, outputs)."""
        plan, failed = self.sched.schedule()
        assert not failed
        if not plan.scheduled:
            return plan, []
        result = self.runner.execute(plan.step)
        if forced:
            result = StepOutput({rid: SampledToken(forced.get(rid, t.token_id)) for rid, t in result.sampled.items()})
            for rid, tok in result.sampled.items():
                self.runner.outputs[rid][-1] = tok.token_id
        self.sched.check_step_output(plan, result)
        return plan, self.sched.update(plan, result)


def _sizes(plan):
    return [(r.request_id, n) for r, n in plan.scheduled]


def test_chunked_prefill_under_budget_with_decode_rows_first():
    h = Harness(block_size=4, num_blocks=32, max_num_batched_tokens=6, max_num_seqs=8)
    h.add("a", list(range(1, 11)), max_tokens=3)
    plan, outs = h.step()
    assert _sizes(plan) == [("a", 6)] and not plan.step.chunks[0].sample and outs == []
    h.add("b", [5, 5, 5], max_tokens=3)
    plan, outs = h.step()
    assert _sizes(plan) == [("a", 4), ("b", 2)]          # a finishes its prompt, b gets a chunk
    assert [c.sample for c in plan.step.chunks] == [True, False]
    assert [o.request_id for o in outs] == ["a"]
    plan, _ = h.step()
    assert _sizes(plan) == [("a", 1), ("b", 1)]          # a decodes one token, b its last prompt token
    assert h.runner.violations == []


def test_max_num_seqs_caps_running():
    h = Harness(block_size=4, num_blocks=32, max_num_batched_tokens=100, max_num_seqs=2)
    for rid in "abc":
        h.add(rid, [1, 2], max_tokens=2)
    plan, _ = h.step()
    assert _sizes(plan) == [("a", 2), ("b", 2)] and [r.request_id for r in h.sched.waiting] == ["c"]
    h.step()
    plan, _ = h.step()                                    # a and b finished: c is admitted
    assert _sizes(plan) == [("c", 2)]


def test_preemption_takes_the_latest_arrival_and_requeues_it_first():
    leases = CountingLeases()
    h = Harness(leases, block_size=2, num_blocks=4, max_num_batched_tokens=16, max_num_seqs=8)
    a = h.add("a", [1, 2, 3], max_tokens=4)
    b = h.add("b", [4, 5, 6], max_tokens=4)
    c = h.add("c", [7], max_tokens=1)                    # no room for c yet: waits
    h.step()                                             # a, b: 2 blocks each, pool full
    h.step()                                             # each computes position 3, still 2 blocks
    assert a.status is b.status is RequestStatus.RUNNING and c.status is RequestStatus.WAITING
    plan, outs = h.step()                                # a needs a 3rd block: b is preempted
    assert plan.preempted == [b] and b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.block_ids == [] and len(b.output_token_ids) == 2
    assert list(h.sched.waiting) == [b, c]
    assert "b" in leases.active                          # a preempted request keeps its lease
    assert _sizes(plan) == [("a", 1)]
    while h.sched.has_unfinished():
        h.step()
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_preemptions >= 1
    assert leases.active == set() and leases.acquires == leases.releases == 3 and not leases.violations
    assert h.runner.violations == []
    h.sched.kv.check_idle()


def test_stop_conditions():
    h = Harness(block_size=4, num_blocks=32, max_num_batched_tokens=64, eos_token_ids=(7,))
    eos = h.add("eos", [1], max_tokens=5, ignore_eos=False)
    ign = h.add("ign", [1], max_tokens=2, ignore_eos=True)
    stop = h.add("stop", [2], max_tokens=5, stop_token_ids=(9,))
    _, outs = h.step(forced={"eos": 7, "ign": 7, "stop": 9})
    by_id = {o.request_id: o for o in outs}
    assert by_id["eos"].finish_reason == "stop" and by_id["eos"].stop_token_id == 7
    assert by_id["eos"].new_token_ids == [7]
    assert by_id["stop"].finish_reason == "stop" and by_id["stop"].stop_token_id == 9
    assert by_id["ign"].finish_reason is None
    _, outs = h.step(forced={"ign": 7})
    assert outs[0].finish_reason == "length" and outs[0].num_completion_tokens == 2
    assert eos.status is RequestStatus.FINISHED_STOPPED and ign.status is RequestStatus.FINISHED_LENGTH
    assert stop.is_finished
    h.sched.kv.check_idle()


def test_abort_in_every_state_returns_blocks_and_leases():
    leases = CountingLeases()
    h = Harness(leases, block_size=2, num_blocks=4, max_num_batched_tokens=16)
    running = h.add("run", [1, 2, 3], max_tokens=8)
    victim = h.add("victim", [4, 5, 6], max_tokens=8)
    waiting = h.add("wait", [7, 8, 9], max_tokens=2)
    for _ in range(3):
        h.step()                                         # the third step preempts "victim"
    assert victim.status is RequestStatus.PREEMPTED and waiting.status is RequestStatus.WAITING
    assert running.status is RequestStatus.RUNNING
    outs = [h.sched.abort(rid) for rid in ("wait", "victim", "run")]
    assert [o.finish_reason for o in outs] == ["abort"] * 3
    assert h.sched.abort("run") is None and h.sched.abort("nope") is None
    assert not h.sched.has_unfinished() and leases.active == set() and not leases.violations
    assert sorted(h.sched.take_finished_ids()) == ["run", "victim", "wait"]
    h.sched.kv.check_idle()


def test_finish_from_above():
    h = Harness(block_size=4, num_blocks=8, max_num_batched_tokens=16)
    h.add("a", [1, 2], max_tokens=10)
    h.step()
    out = h.sched.finish("a", "stop")
    assert out.finish_reason == "stop" and out.num_completion_tokens == 1
    assert h.sched.finish("a") is None
    with pytest.raises(ValueError):
        h.sched.finish("a", "abort")
    h.sched.kv.check_idle()


def test_lease_refusal_keeps_request_waiting_without_blocking_others():
    leases = CountingLeases(capacity=1)
    h = Harness(leases, block_size=4, num_blocks=8, max_num_batched_tokens=16)
    h.add("a", [1], max_tokens=2)
    h.add("b", [2], max_tokens=2)
    plan, _ = h.step()
    assert _sizes(plan) == [("a", 1)] and [r.request_id for r in h.sched.waiting] == ["b"]
    while h.sched.has_unfinished():
        h.step()
    assert leases.acquires == 2 and leases.active == set()


def test_runner_answer_off_contract_is_detected():
    h = Harness(block_size=4, num_blocks=8, max_num_batched_tokens=16)
    h.add("a", [1], max_tokens=2)
    plan, _ = h.sched.schedule()
    with pytest.raises(ValueError):
        h.sched.check_step_output(plan, StepOutput({}))
    with pytest.raises(ValueError):
        h.sched.check_step_output(plan, StepOutput({"a": SampledToken(-1)}))
    outs = h.sched.fail(plan, "boom")
    assert outs[0].finish_reason == "error" and outs[0].error == "boom"
    h.sched.kv.check_idle()


@pytest.mark.parametrize("prompt_len, max_tokens, error", [
    (0, 1, InvalidArgument),
    (17, 1, ContextLengthExceeded),     # prompt alone past max_model_len
    (10, 7, ContextLengthExceeded),     # prompt + max_tokens past max_model_len
    (4, 0, InvalidArgument),
])
def test_requests_that_can_never_run_are_refused(prompt_len, max_tokens, error):
    cfg = EngineConfig(block_size=4, num_blocks=8, max_model_len=16)
    with pytest.raises(error):
        validate_request(cfg, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def test_request_larger_than_the_whole_pool_is_refused():
    cfg = EngineConfig(block_size=4, num_blocks=2, max_model_len=64)
    validate_request(cfg, [1] * 8, SamplingParams(max_tokens=1))          # 8 KV positions: fits
    with pytest.raises(ContextLengthExceeded, match="KV blocks"):
        validate_request(cfg, [1] * 8, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgument):
        validate_request(cfg, [1, -3], SamplingParams())


def test_config_is_validated():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(num_blocks=True)
    with pytest.raises(ValueError, match="eos"):
        EngineConfig(eos_token_ids=[2])
