"""Test doubles for the engine core: a checking FakeRunner, one that refuses requests, counting leases, a driver.

FakeRunner keeps a fake KV cache (slot -> (token, position, salt)) and picks the
next token from the context it READS BACK from that cache, so an output is right
only if every block the core handed out (fresh, shared by prefix hit, or reused
after eviction) holds the right content.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.decoder.engine.config import EngineConfig
from services.decoder.engine.engine_core import EngineCore, choice_ids
from services.decoder.engine.step import SampledToken, SamplingParams, StepInput, StepOutput

VOCAB = 13
EOS = 0


def next_token(context: list[int], salt: int, seed: int | None) -> int:
    """Deterministic in the whole context, its salt and the choice's seed."""
    h = 17 + 1_000_003 * salt + 7919 * (seed or 0)
    for t in context:
        h = (h * 31 + t + 1) % (2**61 - 1)
    return h % VOCAB


def ngram_token(context: list[int], salt: int, seed: int | None) -> int:
    """Mostly a function of the last token, so outputs fall into cycles that prompt lookup
    predicts, but of the whole context at every fifth position, so some drafts are rejected."""
    return next_token(context if len(context) % 5 == 0 else context[-1:], salt, seed)


class InjectedFailure(RuntimeError):
    pass


class FakeRunner:
    """Checks every chunk against the request's true tokens and the KV written so far.

    A broken invariant is recorded in .violations (and raised, failing the step):
    tests assert .violations is empty, since the core turns runner exceptions
    into error outputs. Drafts are verified as a model would: the token predicted
    after each accepted position, read back from the cache, must equal the next
    draft; `rule` is the fake model (next_token, or ngram_token for drafts that
    often hit).
    """

    def __init__(self, config: EngineConfig, fail_calls: frozenset[int] = frozenset(), rule=next_token):
        self.rule = rule
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.kv: dict[int, tuple[int, int, int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        # request id -> its salt: what an adapter is to a real runner (the same tokens, other KV and
        # outputs); the request's extra_keys must carry it so that no prefix hit crosses salts.
        self.salts: dict[str, int] = {}
        self.finished: set[str] = set()
        self.fail_calls = fail_calls
        self.calls = 0
        self.violations: list[str] = []
        self.steps: list[StepInput] = []

    def register(self, request_id: str, prompt: list[int], n: int = 1, salt: int = 0) -> None:
        for rid in choice_ids(request_id, n):
            self.prompts[rid] = list(prompt)
            self.outputs[rid] = []
            self.salts[rid] = salt

    def _violate(self, message: str) -> None:
        self.violations.append(message)
        raise AssertionError(message)

    def _slot(self, table: list[int], p: int) -> int:
        return table[p // self.block_size] * self.block_size + p % self.block_size

    def execute(self, step: StepInput) -> StepOutput:
        call = self.calls
        self.calls += 1
        self.steps.append(step)
        for rid in step.finished_request_ids:
            self.finished.add(rid)
            self.outputs.pop(rid, None)
        if call in self.fail_calls:
            raise InjectedFailure(f"injected failure at call {call}")
        if not step.chunks:
            self._violate("empty step")
        written: dict[int, str] = {}
        for c in step.chunks:
            self._check(c)
            first, last = c.start // self.block_size, (c.start + len(c.token_ids) - 1) // self.block_size
            for b in c.block_table[first:last + 1]:
                if written.setdefault(b, c.request_id) != c.request_id:
                    self._violate(f"block {b} written by {written[b]} and {c.request_id} in one step")
        for c in step.chunks:
            for other in step.chunks:
                if other is not c and set(other.block_table) & {
                        b for b, owner in written.items() if owner == c.request_id}:
                    self._violate(f"{other.request_id} holds a block {c.request_id} writes")
        sampled, accepted = {}, {}
        for c in step.chunks:
            salt = self.salts.get(c.request_id, 0)
            for i, t in enumerate(c.token_ids):
                p = c.start + i
                self.kv[self._slot(c.block_table, p)] = (t, p, salt)
            if c.sample:
                drafts = c.draft_token_ids
                end = c.start + len(c.token_ids) - len(drafts)
                run = []
                for j in range(len(drafts) + 1):
                    context = [self.kv[self._slot(c.block_table, p)][0] for p in range(end + j)]
                    tok = self.rule(context, salt, c.sampling.seed)
                    if j == len(drafts) or tok != drafts[j]:
                        break
                    run.append(SampledToken(tok))
                self.outputs[c.request_id].extend([t.token_id for t in run] + [tok])
                sampled[c.request_id] = SampledToken(tok)
                if run:
                    accepted[c.request_id] = run
        return StepOutput(sampled, accepted)

    def _check(self, c) -> None:
        rid = c.request_id
        if rid in self.finished:
            self._violate(f"chunk for finished request {rid}")
        if rid not in self.prompts:
            self._violate(f"unknown request {rid}")
        known = self.prompts[rid] + self.outputs[rid]
        real = c.token_ids[:len(c.token_ids) - len(c.draft_token_ids)]
        end = c.start + len(real)
        if c.output_token_ids != self.outputs[rid] or c.num_prompt_tokens != len(self.prompts[rid]):
            self._violate(f"{rid}: outputs {c.output_token_ids} != sampled {self.outputs[rid]}")
        if not real or c.start < 0 or end > len(known) or real != known[c.start:end]:
            self._violate(f"{rid}: chunk {c.start}+{c.token_ids} does not match tokens {known}")
        if c.sample != (end == len(known)) or (c.draft_token_ids and not c.sample):
            self._violate(f"{rid}: sample={c.sample} but chunk ends at {end} of {len(known)}")
        if len(c.block_table) * self.block_size < c.start + len(c.token_ids) \
                or len(set(c.block_table)) != len(c.block_table) \
                or any(not 0 <= b < self.num_blocks for b in c.block_table):
            self._violate(f"{rid}: bad block table {c.block_table} for {end} positions")
        salt = self.salts.get(rid, 0)
        for p in range(c.start):
            if self.kv.get(self._slot(c.block_table, p)) != (known[p], p, salt):
                self._violate(f"{rid}: KV at position {p} is {self.kv.get(self._slot(c.block_table, p))}, "
                              f"expected {(known[p], p, salt)}")


class RefusingRunner(FakeRunner):
    """Refuses, as the real runner does (runner/runner.py), every chunk holding a token id outside the
    vocabulary: it names the request in StepOutput.failed and runs the step's other chunks alone."""

    def execute(self, step: StepInput) -> StepOutput:
        failed = {c.request_id: "InvalidArgument: token ids must be in [0, 13)" for c in step.chunks
                  if max(c.token_ids) >= VOCAB}
        kept = [c for c in step.chunks if c.request_id not in failed]
        if not kept:
            self.finished.update(step.finished_request_ids)
            return StepOutput({}, failed=failed)
        out = super().execute(StepInput(kept, step.finished_request_ids))
        return StepOutput(out.sampled, out.accepted, failed)


class CountingLeases:
    """Adapter-lease double: at most `capacity` held at once (None: unlimited)."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.active: set[str] = set()
        self.acquires = 0
        self.releases = 0
        self.violations: list[str] = []

    def acquire(self, request) -> bool:
        if request.request_id in self.active:
            self.violations.append(f"double acquire {request.request_id}")
        if self.capacity is not None and len(self.active) >= self.capacity:
            return False
        self.active.add(request.request_id)
        self.acquires += 1
        return True

    def release(self, request) -> None:
        if request.request_id not in self.active:
            self.violations.append(f"release without lease {request.request_id}")
        self.active.discard(request.request_id)
        self.releases += 1


@dataclass
class Job:
    request_id: str
    prompt: list[int]
    max_tokens: int
    n: int = 1
    arrival_step: int = 0
    abort_step: int | None = None
    salt: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, n=self.n, seed=self.seed,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


@dataclass
class RunResult:
    tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    reasons: dict[tuple[str, int], str] = field(default_factory=dict)
    cached: dict[tuple[str, int], int] = field(default_factory=dict)
    steps: int = 0


def drive(core: EngineCore, runner: FakeRunner, jobs: list[Job], *, timed: bool = True,
          max_steps: int = 5000) -> RunResult:
    """Add jobs at their arrival steps (all at once if not timed), abort at abort steps,
    step until nothing is left; collect each choice's tokens and finish reason."""
    res = RunResult()
    pending = sorted(jobs, key=lambda j: j.arrival_step if timed else 0)
    step = 0
    while True:
        while pending and (not timed or pending[0].arrival_step <= step):
            job = pending.pop(0)
            runner.register(job.request_id, job.prompt, job.n, salt=job.salt)
            core.add_request(job.request_id, job.prompt, job.sampling(), extra_keys=(("salt", job.salt),))
            for i in range(job.n):
                res.tokens[(job.request_id, i)] = []
        if timed:
            for job in jobs:
                if job.abort_step == step:
                    core.abort(job.request_id)
        for out in core.step():
            key = (out.request_id, out.index)
            if key in res.reasons:
                raise AssertionError(f"output after finish for {key}: {out}")
            res.tokens[key].extend(out.new_token_ids)
            if out.num_completion_tokens != len(res.tokens[key]):
                raise AssertionError(f"{key}: completion count {out.num_completion_tokens} != {res.tokens[key]}")
            if out.finished:
                res.reasons[key] = out.finish_reason
                res.cached[key] = out.num_cached_tokens
        step += 1
        if not pending and not core.has_unfinished():
            res.steps = step
            return res
        if step > max_steps:
            raise AssertionError(f"no progress after {max_steps} steps: {core.stats()}")
