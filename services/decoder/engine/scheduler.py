"""Continuous batching with chunked prefill, prefix hits and recompute preemption. No torch.

There are no prefill or decode phases. Each step walks the running requests
oldest first and gives each min(uncomputed tokens, remaining budget) tokens: a
decoding request has exactly one uncomputed token (its last sample), a long
prompt gets a chunk. When the pool has no room for a running request, the most
recently arrived running request is preempted: its blocks are freed, its
computed count drops to 0 and it goes back to the front of the waiting queue
with its outputs, which are recomputed as part of its tokens. Then waiting
requests are admitted first come, first served while budget, seats and blocks
allow. A waiting request whose next uncached full blocks another running request
is computing (the same system prompt, the choices of an n > 1 request) waits when
they are at least half of what it has left: next step it finds them in the prefix
cache instead of computing them again in the same forward, and others may pass
meanwhile. A request whose adapter has no room yet (Leases.acquire False) lets
later requests pass, but only LEASE_PATIENCE times: after that nobody overtakes
it, so the adapters that hold the room go idle as their requests finish and one
can be evicted for it (a popular adapter cannot keep a cold one out forever).

Speculative decoding (EngineConfig.speculative) only adds tokens to decode chunks:
a decoding request whose context repeats an n-gram gets its last token plus the
drafts that followed there (engine/drafter.py), verified in the same forward as
everyone else's tokens. Drafts are capped so that the whole run fits max_tokens,
max_model_len, the step budget and the min_tokens regime, and carry no stop
token; so only the run's last token can end the request. After the step, the
computed count covers the accepted drafts only; blocks that held nothing but
rejected positions go back to the pool, and only accepted tokens are hashed into
the prefix cache. A step with disable_by_batch_size or more running requests
drafts nothing. With a DraftGate (the engine's, from the verify costs the runner measured
at load), a request whose drafts do not pay for the rows that verify them stops
proposing for a while (engine/drafter.py).

Prompt logprobs (SamplingParams.prompt_logprobs): until a request holds a score
for every prompt token, its chunks ask the runner to score their prompt rows
and it reads no prefix-cache hits (a cached position has no logits to score);
its first output once the prompt is computed carries them. With max_tokens 0 the
prompt's last chunk is not sampled and the request ends there ("length").
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from services.common.errors import ContextLengthExceeded, InvalidArgument, TesseraError
from services.decoder.engine.config import EngineConfig
from services.decoder.engine.drafter import DraftGate, NgramDrafter
from services.decoder.engine.kv_cache_manager import KVCacheManager, cdiv
from services.decoder.engine.output import RequestOutput
from services.decoder.engine.request import Request, RequestStatus
from services.decoder.engine.step import SampledToken, SamplingParams, ScheduledChunk, StepInput, StepOutput

# Schedules at which a request may find no adapter room and still let later requests pass it.
LEASE_PATIENCE = 16


class Leases(Protocol):
    """Adapter-slot leases. acquire runs when a request is first scheduled (not
    again after preemption); False means "no slot yet, keep waiting", a raised
    TesseraError fails the request. release runs once on finish, abort or error."""

    def acquire(self, request: Request) -> bool: ...

    def release(self, request: Request) -> None: ...


class NoLeases:
    def acquire(self, request: Request) -> bool:
        return True

    def release(self, request: Request) -> None:
        return None


@dataclass
class SchedulerOutput:
    """One step's plan: (request, tokens) pairs in chunk order, and the runner's input."""

    scheduled: list[tuple[Request, int]]
    step: StepInput
    preempted: list[Request] = field(default_factory=list)


def validate_request(config: EngineConfig, prompt_token_ids: list[int] | tuple[int, ...],
                     sampling: SamplingParams) -> None:
    """Refuse what can never run: InvalidArgument / ContextLengthExceeded."""
    if not prompt_token_ids:
        raise InvalidArgument("the prompt is empty", param="prompt")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= 2**63 for t in prompt_token_ids):
        raise InvalidArgument("prompt token ids must be non-negative integers", param="prompt")
    if config.vocab_size and max(prompt_token_ids) >= config.vocab_size:
        raise InvalidArgument(f"prompt token id {max(prompt_token_ids)} is outside the vocabulary "
                              f"[0, {config.vocab_size})", param="prompt")
    scored = sampling.prompt_logprobs
    if scored is not None and (isinstance(scored, bool) or not isinstance(scored, int) or scored < 0):
        raise InvalidArgument(f"prompt_logprobs must be a non-negative int, got {scored!r}", param="prompt_logprobs")
    least = 0 if scored is not None else 1      # a scored prompt may generate nothing
    if isinstance(sampling.max_tokens, bool) or not isinstance(sampling.max_tokens, int) \
            or sampling.max_tokens < least:
        raise InvalidArgument(f"max_tokens must be at least {least}, got {sampling.max_tokens!r}",
                              param="max_tokens")
    if isinstance(sampling.n, bool) or not isinstance(sampling.n, int) or sampling.n < 1:
        raise InvalidArgument(f"n must be at least 1, got {sampling.n!r}", param="n")
    if not 0 <= sampling.min_tokens <= sampling.max_tokens:
        raise InvalidArgument(f"min_tokens must be in [0, max_tokens {sampling.max_tokens}], got "
                              f"{sampling.min_tokens!r}", param="min_tokens")
    num_prompt, limit = len(prompt_token_ids), config.max_model_len
    if num_prompt > limit:
        raise ContextLengthExceeded(
            f"the prompt has {num_prompt} tokens; the maximum context length is {limit}", param="prompt")
    if num_prompt + sampling.max_tokens > limit:
        raise ContextLengthExceeded(
            f"{num_prompt} prompt tokens + max_tokens {sampling.max_tokens} exceed the maximum context "
            f"length {limit}", param="max_tokens")
    # KV is needed for every position but the last sampled one.
    need = cdiv(num_prompt + max(sampling.max_tokens, 1) - 1, config.block_size)
    if need > config.num_blocks:
        raise ContextLengthExceeded(
            f"{num_prompt} prompt tokens + max_tokens {sampling.max_tokens} need {need} KV blocks; "
            f"the cache holds {config.num_blocks}", param="max_tokens")


class Scheduler:
    """Owns the waiting queue, the running set and the KV-cache manager. Not thread-safe:
    one loop calls add/abort/finish/schedule/update."""

    def __init__(self, config: EngineConfig, leases: Leases | None = None, gate: DraftGate | None = None):
        """gate: with speculative decoding, which requests' drafts pay (None: every n-gram hit is drafted)."""
        self.config = config
        self.leases: Leases = leases if leases is not None else NoLeases()
        self.kv = KVCacheManager(config.block_size, config.num_blocks, config.enable_prefix_caching,
                                 config.attention_reach)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        spec = config.speculative
        self.drafter = NgramDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min) if spec else None
        # Speculative decoding counters: drafted / accepted tokens, chunks that carried drafts.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
        self.gate = gate if spec else None
        self.num_steps = 0              # schedule() calls: the clock of the gate's pauses
        self.num_draft_scans = 0        # proposals scanned (each request, each step it may draft)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidArgument(f"duplicate request id {request.request_id!r}", param="request_id")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_finished_ids(self) -> list[str]:
        """Ids finished since the last call, so the runner can drop per-request state."""
        ids, self._finished_ids = self._finished_ids, []
        return ids

    # -- planning -------------------------------------------------------------

    def schedule(self) -> tuple[SchedulerOutput, list[RequestOutput]]:
        """Plan one step. Also returns outputs of requests failed while planning
        (a lease hook that raised)."""
        self.num_steps += 1
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        failed: list[RequestOutput] = []
        # Oldest first, so the preemption victim (the latest arrival) is always
        # at the end and never one already given tokens in this step.
        self.running.sort(key=lambda r: r.arrival_seq)
        spec = self.config.speculative
        drafting = spec is not None and len(self.running) < spec.disable_by_batch_size
        drafts: dict[str, list[int]] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                raise RuntimeError(f"running request with nothing to compute: {req}")
            draft = self._draft(req, budget) if drafting and req.num_tokens - req.num_computed_tokens == 1 else []
            while self.kv.allocate_slots(req, n + len(draft)) is None:
                if draft:               # drafts are the first thing to give up, before anyone's KV
                    draft = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            if draft:
                drafts[req.request_id] = draft
            scheduled.append((req, n + len(draft)))
            budget -= n + len(draft)
            i += 1

        # Admitting while we just preempted would only thrash the same blocks.
        if not preempted:
            budget = self._admit(budget, scheduled, failed)

        chunks = [self._chunk(req, n, drafts.get(req.request_id, [])) for req, n in scheduled]
        return SchedulerOutput(scheduled, StepInput(chunks), preempted), failed

    def _draft(self, req: Request, budget: int) -> list[int]:
        """Drafts for a decoding request: as many as the whole run (drafts + 1) may emit without
        passing max_tokens or max_model_len, fitting the budget, and all inside the min_tokens
        regime of the first (the sampler blocks stop tokens alike on every row of a chunk)."""
        sampling = req.sampling
        limit = min(self.config.speculative.num_speculative_tokens, budget - 1,
                    sampling.max_tokens - req.num_output_tokens - 1,
                    self.config.max_model_len - req.num_tokens - 1)
        if req.num_output_tokens < sampling.min_tokens:
            limit = min(limit, sampling.min_tokens - req.num_output_tokens - 1)
        if limit < 1 or (self.gate is not None and not self.gate.wants(req.drafting, self.num_steps)):
            return []
        if self.gate is not None:
            limit = self.gate.length(req.drafting, limit)
        self.num_draft_scans += 1
        started = time.perf_counter()
        draft = self.drafter.propose(req.all_token_ids, limit, frozenset(self._stop_ids(req)))
        req.drafting.scan_s = time.perf_counter() - started
        if not draft and self.gate is not None:     # a miss: the scan, for nothing
            self.gate.observe(req.drafting, self.num_steps, 0, 0, req.drafting.scan_s)
        return draft

    def _admit(self, budget: int, scheduled: list[tuple[Request, int]], failed: list[RequestOutput]) -> int:
        skipped: list[Request] = []
        # Full blocks the running requests are still to compute, by hash: a waiting request whose next blocks
        # are among them may wait to hit them (_waits_for).
        pending = {h for r in self.running for h in self.kv.uncomputed_hashes(r)} if self.waiting else set()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            hits, num_hit = self.kv.get_computed_blocks(req)
            if req.scores_prompt:
                hits, num_hit = [], 0   # every prompt position must have logits to score it
            elif self._waits_for(req, num_hit, pending):
                skipped.append(req)
                continue
            n = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                self.waiting.appendleft(req)
                break                   # first come, first served: nobody overtakes for blocks
            # Lease after the blocks are secured: a refused or retried allocation
            # then never churns adapter slots, only our own free queue.
            if not req.holds_lease:
                try:
                    granted = self.leases.acquire(req)
                except TesseraError as exc:
                    failed.append(self._finish(req, RequestStatus.FINISHED_ERROR, error=exc.message))
                    continue
                if not granted:
                    self.kv.free(req)
                    skipped.append(req)
                    req.lease_refusals += 1
                    if req.lease_refusals > LEASE_PATIENCE:
                        break           # it has waited long enough: no one overtakes it any more
                    continue
                req.holds_lease = True
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
            pending.update(self.kv.uncomputed_hashes(req))
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _waits_for(self, req: Request, num_hit: int, pending: set[bytes]) -> bool:
        """Whether req waits a step for blocks other running requests are computing: when the run of them
        that follows its hits is at least half of what it has left to compute. Waiting costs it a step; a
        chat template's first block shared before a long prompt of its own is not worth that."""
        if not pending:
            return False
        shared = 0
        for block_hash in self.kv.hittable_hashes(req, num_hit):
            if block_hash not in pending:
                break
            shared += self.config.block_size
        return shared > 0 and 2 * shared >= req.num_tokens - num_hit

    def _chunk(self, req: Request, n: int, draft: list[int]) -> ScheduledChunk:
        start = req.num_computed_tokens
        known = n - len(draft)
        # max_tokens 0 (a scored prompt alone): the prompt's last chunk is not sampled.
        sample = start + known == req.num_tokens and req.sampling.max_tokens > 0
        return ScheduledChunk(
            request_id=req.request_id, token_ids=req.all_token_ids[start:start + known] + draft, start=start,
            block_table=list(req.block_ids), sample=sample, sampling=req.sampling,
            output_token_ids=list(req.output_token_ids), num_prompt_tokens=req.num_prompt_tokens,
            images=req.images, lora_slot=None if req.adapter is None else req.adapter.slot, grammar=req.grammar,
            prompt_token_ids=req.prompt_token_ids,
            blocked_token_ids=self._stop_ids(req) if req.num_output_tokens < req.sampling.min_tokens else (),
            draft_token_ids=draft, prompt_logprobs=req.sampling.prompt_logprobs if req.scores_prompt else None)

    def _stop_ids(self, req: Request) -> tuple[int, ...]:
        """The ids whose sampling would end the request (EOS unless ignore_eos, and stop_token_ids)."""
        eos = () if req.sampling.ignore_eos else self.config.eos_token_ids
        return tuple(dict.fromkeys((*eos, *req.sampling.stop_token_ids)))

    def _preempt(self, req: Request) -> None:
        # The lease stays: the request resumes with the same adapter and KV salt.
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- results --------------------------------------------------------------

    def check_step_output(self, plan: SchedulerOutput, result: StepOutput) -> None:
        """Raise ValueError unless result samples exactly the chunks marked sample, less those it
        refused (result.failed, which must name chunks of this step)."""
        unknown = set(result.failed) - {c.request_id for c in plan.step.chunks}
        if unknown:
            raise ValueError(f"runner refused {sorted(unknown)}, which are not in the step")
        expected = {c.request_id for c in plan.step.chunks if c.sample} - set(result.failed)
        got = set(result.sampled)
        if got != expected:
            raise ValueError(f"runner sampled {sorted(got)}, expected {sorted(expected)}")
        asked = {c.request_id for c in plan.step.chunks if c.prompt_logprobs is not None}
        unasked = set(result.prompt_logprobs) - asked
        if unasked:
            raise ValueError(f"runner scored the prompts of {sorted(unasked)}, which did not ask")
        drafts = {c.request_id: c.draft_token_ids for c in plan.step.chunks}
        for rid, toks in result.accepted.items():
            ids = [t.token_id for t in toks]
            if ids != drafts.get(rid, [])[:len(ids)] or (ids and rid not in expected):
                raise ValueError(f"runner accepted {ids} for {rid}, not a prefix of its drafts {drafts.get(rid)}")
        for rid, tok in result.sampled.items():
            if isinstance(tok.token_id, bool) or not isinstance(tok.token_id, int) or tok.token_id < 0:
                raise ValueError(f"runner returned token id {tok.token_id!r} for {rid}")

    def update(self, plan: SchedulerOutput, result: StepOutput) -> list[RequestOutput]:
        """Advance computed counts, register newly full blocks, append samples and apply stop rules.
        A request the runner refused finishes with "error"; its blocks and lease go back."""
        outputs = []
        for (req, n), chunk in zip(plan.scheduled, plan.step.chunks, strict=True):
            why = result.failed.get(req.request_id)
            if why is not None:
                outputs.append(self._finish(req, RequestStatus.FINISHED_ERROR, error=why))
                continue
            scores = result.prompt_logprobs.get(req.request_id)
            if scores is not None:
                req.add_prompt_logprobs(chunk.start, scores)
            if not chunk.sample:        # a prefill chunk that did not reach the end
                req.num_computed_tokens += n
                self.kv.cache_computed_blocks(req)
                self.kv.release_passed(req)
                req.prompt_done = req.prompt_done or req.num_computed_tokens >= req.num_prompt_tokens
                if req.prompt_done and req.sampling.max_tokens == 0:
                    outputs.append(self._finish(req, RequestStatus.FINISHED_LENGTH))
                continue
            accepted = result.accepted.get(req.request_id, [])
            if chunk.draft_token_ids:
                self.num_verifications += 1
                self.num_draft_tokens += len(chunk.draft_token_ids)
                self.num_accepted_tokens += len(accepted)
                if self.gate is not None:
                    self.gate.observe(req.drafting, self.num_steps, len(chunk.draft_token_ids), len(accepted),
                                      req.drafting.scan_s)
            # KV now holds the known tokens and the accepted drafts; a rejected draft's is garbage
            # that the position's real token overwrites before anything reads it.
            req.num_computed_tokens += n - len(chunk.draft_token_ids) + len(accepted)
            req.prompt_done = req.prompt_done or req.num_computed_tokens >= req.num_prompt_tokens
            emitted: list[SampledToken] = []
            status = None
            for tok in [*accepted, result.sampled[req.request_id]]:
                req.append_output(tok.token_id)
                emitted.append(tok)
                status = self._stop_status(req, tok.token_id, tok.complete)
                if status is not None:
                    break               # the rest of the run is dropped, its KV never counted
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            self.kv.cache_computed_blocks(req)
            if status is None:
                self.kv.trim(req)
                self.kv.release_passed(req)
                outputs.append(self._output(req, emitted))
            else:
                outputs.append(self._finish(req, status, new_tokens=emitted))
        return outputs

    def fail(self, plan: SchedulerOutput, message: str) -> list[RequestOutput]:
        """Finish every request of a failed step with an error; their blocks go back."""
        return [self._finish(req, RequestStatus.FINISHED_ERROR, error=message)
                for req, _ in plan.scheduled if not req.is_finished]

    def _stop_status(self, req: Request, token_id: int, complete: bool = False) -> RequestStatus | None:
        sampling = req.sampling
        if complete:
            # The runner's grammar is complete: nothing may follow. A stop token that completed it is
            # counted but not shown, like any other.
            if token_id in self.config.eos_token_ids or token_id in sampling.stop_token_ids:
                req.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        # min_tokens: a stop token counts only after that many other tokens (vLLM's rule; the sampler
        # blocks them until then, so this matters only for a runner that ignores blocked_token_ids).
        if req.num_output_tokens > sampling.min_tokens and (
                (not sampling.ignore_eos and token_id in self.config.eos_token_ids)
                or token_id in sampling.stop_token_ids):
            req.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sampling.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- ending ---------------------------------------------------------------

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        return None if req is None else self._finish(req, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, reason: str = "stop") -> RequestOutput | None:
        """End a request from above (a stop string seen in its text); None if already gone."""
        statuses = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}
        if reason not in statuses:
            raise ValueError(f"finish reason must be 'stop' or 'length', got {reason!r}")
        req = self.requests.get(request_id)
        return None if req is None else self._finish(req, statuses[reason])

    def _finish(self, req: Request, status: RequestStatus, *, new_tokens: list[SampledToken] | None = None,
                error: str | None = None) -> RequestOutput:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:       # identity: Request has no __eq__
            self.waiting.remove(req)
        self.kv.free(req)
        if req.holds_lease:
            self._release(req)
        req.status = status
        req.error = error
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)
        return self._output(req, new_tokens or [])

    def _release(self, req: Request) -> None:
        req.holds_lease = False
        self.leases.release(req)

    @staticmethod
    def _output(req: Request, new_tokens: list[SampledToken]) -> RequestOutput:
        # The first output once the prompt is computed carries what is known of the prompt (its counts are
        # final, its scores complete).
        first = req.prompt_done and not req.prompt_reported
        req.prompt_reported = req.prompt_reported or first
        return RequestOutput(
            request_id=req.parent_id, index=req.index, new_tokens=new_tokens,
            finish_reason=req.status.finish_reason, stop_token_id=req.stop_token_id, error=req.error,
            num_prompt_tokens=req.num_prompt_tokens, num_completion_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens, first=first,
            prompt_logprobs=list(req.prompt_logprobs) if first and req.prompt_logprobs is not None else None)
