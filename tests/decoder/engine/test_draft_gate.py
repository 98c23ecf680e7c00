"""The draft gate (engine/drafter.py DraftGate): a request whose drafts do not pay for the rows that verify
them stops proposing after a few attempts; one whose drafts are accepted keeps drafting. Through the engine
core against the FakeRunner, with verify costs given as the runner's measurement would give them."""
import pytest

from services.decoder.engine.config import EngineConfig, SpeculativeConfig
from services.decoder.engine.drafter import DraftGate, DraftRecord, VerifyCost
from services.decoder.engine.engine_core import EngineCore

from .fakes import EOS, FakeRunner, Job, drive, next_token, ngram_token

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2, disable_by_batch_size=8)
# A step verifying k drafts costs 1 + 0.1 k one-row steps (a weight-bound decode step on a CPU).
COST = tuple(1e-3 * (1 + 0.1 * k) for k in range(SPEC.num_speculative_tokens + 1))
MAX_TOKENS = 48
# No 2-gram repeats in the prompt, and next_token (a hash of the whole context) rarely repeats one: nearly
# every scan misses, and the rare draft is rejected.
FRESH = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 3, 6, 9, 12, 2, 5, 8, 11, 1, 4, 7, 10]
# Under ngram_token the outputs fall into cycles that prompt lookup predicts (tests/decoder/engine/fakes.py);
# copying() continues this prompt with the first of them, so that drafts pay from the first decode step.
CYCLING = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


class MeasuringRunner(FakeRunner):
    """The FakeRunner with the verify costs a real runner measures at load (None: pinned to draft always)."""

    def __init__(self, config, rule, seconds):
        super().__init__(config, rule=rule)
        self.seconds = seconds

    def verify_seconds(self, max_drafts: int):
        return None if self.seconds is None else self.seconds[:max_drafts + 1]


def copying() -> list[int]:
    _, plain = run(CYCLING, ngram_token, None)
    return CYCLING + plain.tokens[("r", 0)][:24]


def run(prompt, rule, seconds):
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, max_model_len=128,
                          eos_token_ids=(EOS,), speculative=SPEC)
    runner = MeasuringRunner(config, rule, seconds)
    core = EngineCore(runner, config)
    result = drive(core, runner, [Job("r", prompt, MAX_TOKENS, ignore_eos=True)])
    assert not runner.violations
    return core, result


@pytest.mark.parametrize("seconds", [COST, None], ids=["adaptive", "always"])
def test_a_request_without_repeats_stops_drafting_after_a_few_steps(seconds):
    core, result = run(FRESH, next_token, seconds)
    scheduler = core.scheduler
    assert scheduler.num_accepted_tokens == 0
    if seconds is None:     # pinned always: it scans at every decode step with room for a draft (not the last)
        assert scheduler.gate is None and scheduler.num_draft_scans == MAX_TOKENS - 2
        return
    # WARMUP attempts, a pause of FIRST_PAUSE steps, WARMUP more, a pause twice as long (past the end).
    assert scheduler.gate.num_pauses == 2
    assert scheduler.num_draft_scans == 2 * DraftGate.WARMUP
    # The outputs are the gate-less run's, token for token.
    _, plain = run(FRESH, next_token, None)
    assert result.tokens == plain.tokens


@pytest.mark.parametrize("seconds", [COST, None], ids=["adaptive", "always"])
def test_a_copying_request_keeps_drafting(seconds):
    prompt = copying()
    core, result = run(prompt, ngram_token, seconds)
    scheduler = core.scheduler
    assert scheduler.num_accepted_tokens > scheduler.num_verifications     # more than one accepted per verify
    if seconds is not None:
        assert scheduler.gate.num_pauses == 0
    # Every decode step that had room for a draft scanned (fewer steps than tokens: drafts were accepted).
    assert scheduler.num_draft_scans >= scheduler.num_verifications
    _, plain = run(prompt, ngram_token, None)
    assert result.tokens == plain.tokens


def test_expensive_verification_stops_even_accepted_drafts():
    """The break-even is the measurement's: where verifying 4 drafts costs 5 one-row steps, even a copying
    request's drafts (fewer than 4 accepted per verify on average) do not pay."""
    core, _ = run(copying(), ngram_token, tuple(1e-3 * (1 + 1.0 * k) for k in range(5)))
    assert core.scheduler.gate.num_pauses >= 1


def test_the_gate_pauses_longer_each_time_and_resumes():
    gate = DraftGate(VerifyCost((1.0, 1.2, 1.4)))
    record, step = DraftRecord(), 0
    for pause in (gate.FIRST_PAUSE, 2 * gate.FIRST_PAUSE):
        for _ in range(gate.WARMUP):
            step += 1
            assert gate.wants(record, step)
            gate.observe(record, step, 2, 0, 1e-6)          # 2 drafts, none accepted: -0.4 each
        assert not gate.wants(record, step + pause) and gate.wants(record, step + pause + 1)
        step += pause
    for _ in range(gate.WARMUP):                             # then drafts that pay: the pause resets
        step += 1
        gate.observe(record, step, 2, 2, 1e-6)
    assert record.pause == 0 and gate.wants(record, step + 1) and gate.num_pauses == 2


def test_the_draft_length_follows_the_acceptance_and_the_verify_costs():
    """Full length before any verify; after rejections, fewer drafts where each extra verify row costs more than
    the next draft is likely to gain; after acceptances, full length again."""
    gate = DraftGate(VerifyCost((1.0, 1.05, 1.15, 1.45, 1.5)))     # as timed on a 2-core CPU: 4 rows cost much more
    record = DraftRecord()
    assert gate.length(record, 4) == 4 and gate.length(record, 2) == 2
    for step in range(3):
        gate.observe(record, step, 4, 0, 1e-6)                     # nothing accepted: p = 0
    assert gate.length(record, 4) == 1
    for step in range(3, 12):
        gate.observe(record, step, 1, 1, 1e-6)                     # every draft accepted
    assert gate.length(record, 4) == 4
    record.hits, record.trials = 1.0, 2.0                          # p = 1/2: a third draft gains 1/8 for 0.3
    assert gate.length(record, 4) == 2


@pytest.mark.parametrize("seconds", [(), (1.0, 0.0), (-1.0,)])
def test_verify_costs_must_be_positive(seconds):
    with pytest.raises(ValueError, match="positive"):
        VerifyCost(seconds)
