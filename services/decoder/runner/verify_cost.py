"""What verifying drafts costs on this machine: a decode step of one request with k drafts (1 + k rows), timed
at load for k = 0..max_drafts through the runner's own step (its forward path, head and sampler), so that the
engine's draft gate (engine/drafter.py) weighs a request's accepted drafts against the measured price of the
rows that verify them, not against a constant tuned on one CPU (docs/design.md, speculative decoding).

The choice "speculation" of the execution plan: `adaptive` (the default) gates drafting per request on these
timings; `--fast-paths speculation=always` drafts wherever an n-gram repeats, as before the gate, and times
nothing.
"""
from __future__ import annotations

import torch

from services.common import plan as execution
from services.decoder.engine.step import SamplingParams, ScheduledChunk, StepInput

# The context the timed steps read (keys per row): a chat's early decode steps.
CONTEXT = 128
PROBE_ID = "verify-cost-probe"


def step_input(context: int, drafts: int, block_size: int, vocab_size: int) -> StepInput:
    """One decode chunk at `context` keys carrying `drafts` drafts, on blocks 0.. of the cache."""
    blocks = list(range(-(-(context + drafts) // block_size)))
    tokens = [(7 * i + 1) % vocab_size for i in range(1 + drafts)]
    prompt = [(3 * i + 2) % vocab_size for i in range(context - 1)]
    return StepInput([ScheduledChunk(
        request_id=PROBE_ID, token_ids=tokens, start=context - 1, block_table=blocks, sample=True,
        sampling=SamplingParams(temperature=0.0, max_tokens=drafts + 1), num_prompt_tokens=context - 1,
        prompt_token_ids=prompt, draft_token_ids=tokens[1:])])


@torch.inference_mode()
def measure(runner, max_drafts: int, record: execution.ExecutionPlan) -> tuple[float, ...] | None:
    """Seconds of a one-request decode step with k drafts, k = 0..max_drafts (the minimum over the plan's
    interleaved rounds), recorded as the choice "speculation"; None when pinned `always` or when the cache
    is too small to time the step (the gate is then off and every n-gram hit is drafted)."""
    if record.pinned("speculation") == "always":
        record.record("speculation", "always")
        return None
    bs = runner.block_size
    context = min(CONTEXT, runner.num_blocks * bs - max_drafts)
    if context < 2:
        record.record("speculation", "always", reason=f"a cache of {runner.num_blocks} blocks cannot time a step")
        return None
    steps = {k: step_input(context, k, bs, runner.vocab_size) for k in range(max_drafts + 1)}
    try:
        best = execution.fastest({str(k): (lambda s=s: runner.execute(s)) for k, s in steps.items()})
    finally:
        runner.sampler.grammars.states.forget([PROBE_ID])   # as a finished request's
        used = -(-(context + max_drafts) // bs)
        for k, v in zip(runner.cache.k, runner.cache.v, strict=True):
            k[:used].zero_()            # no request owns a block at load: leave them as found
            v[:used].zero_()
    seconds = tuple(best[str(k)] for k in range(max_drafts + 1))
    record.record("speculation", "adaptive", [execution.Timing("step", t, 1 + k) for k, t in enumerate(seconds)],
                  reason=f"a step verifying {max_drafts} drafts costs {seconds[-1] / seconds[0]:.2f} one-row steps")
    return seconds
