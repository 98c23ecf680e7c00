"""The engine core: requests in, one runner call per step, per-choice outputs out. No torch.

n > 1: an API request with n choices becomes n requests "<id>#<i>" sharing the
prompt (choice i gets seed + i when a seed is given, so seeded choices differ but
stay reproducible). Their prompt blocks are shared through the prefix cache:
with prefix caching on, choices 1..n-1 wait in the queue until choice 0 has
computed its prompt once; they are then admitted with hits on every full prompt
block (ref counts > 1, one copy of the KV) and recompute only the partial last
block. The price is that the siblings start one prefill later; in exchange no
runner has to read KV written by another row of the same forward. Without
prefix caching all choices start together, each with its own blocks.

Not thread-safe: one loop (a thread or process off the event loop) calls
add_request / abort / finish / step.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from services.common.errors import InvalidArgument
from services.decoder.engine.config import EngineConfig
from services.decoder.engine.drafter import DraftGate, VerifyCost
from services.decoder.engine.output import EngineStats, RequestOutput
from services.decoder.engine.request import AdapterRef, Request, SpanKey
from services.decoder.engine.scheduler import Leases, Scheduler, validate_request
from services.decoder.engine.step import CompiledGrammar, PlacedImages, Runner, SamplingParams

log = logging.getLogger("tessera.decoder.engine")


def choice_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of an API request's n choices (what chunks carry)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def draft_gate(runner: Runner, config: EngineConfig) -> DraftGate | None:
    """With speculative decoding, the gate on the verify costs the runner measures now (Runner.verify_seconds);
    None without speculation, for a runner that does not measure (fakes), or one pinned to draft always."""
    measure = getattr(runner, "verify_seconds", None)
    if config.speculative is None or measure is None:
        return None
    seconds = measure(config.speculative.num_speculative_tokens)
    return None if seconds is None else DraftGate(VerifyCost(tuple(seconds)))


class EngineCore:
    def __init__(self, runner: Runner, config: EngineConfig, leases: Leases | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.runner = runner
        # A runner whose every layer slides says how far its queries read back (Runner.attention_reach); then
        # the scheduler returns blocks that left the window while their request runs. Fakes need not say.
        reach = getattr(runner, "attention_reach", None)
        if reach is not None and config.attention_reach != reach:
            config = replace(config, attention_reach=reach)
        self.config = config
        self.scheduler = Scheduler(config, leases, draft_gate(runner, config))
        self._clock = clock
        self._arrivals = itertools.count()
        self._choices: dict[str, list[str]] = {}     # API request id -> its engine request ids
        self._pending: list[RequestOutput] = []      # ends decided between steps (abort, finish)
        self.num_steps = 0
        # Why the last step's runner call raised (None when it answered): a device-level failure,
        # unlike a request the runner refused (StepOutput.failed), which fails that request alone.
        self.step_error: str | None = None
        self._fault_at_step = 0

    # -- requests -------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams, *,
                    extra_keys: tuple = (), span_keys: tuple[SpanKey, ...] = (),
                    images: PlacedImages | None = None, adapter: AdapterRef | None = None,
                    grammar: CompiledGrammar | None = None) -> None:
        """Queue an API request (sampling.n choices). Raises InvalidArgument or
        ContextLengthExceeded, with nothing queued, for a request that can never run.

        prompt_token_ids are physical: image placeholders already expanded (images places them).
        adapter: the LoRA adapter (its digest belongs in extra_keys too); each choice leases its
        own slot. grammar: the compiled constraint the runner's sampler enforces on every choice.
        """
        prompt = list(prompt_token_ids)
        validate_request(self.config, prompt, sampling)
        n = sampling.n
        ids = choice_ids(request_id, n)
        if request_id in self._choices or any(i in self.scheduler.requests for i in ids):
            raise InvalidArgument(f"duplicate request id {request_id!r}", param="request_id")
        # The choices share the prompt's full blocks: the scheduler admits the others once the first has
        # computed them (scheduler.py, a block another request is computing).
        for index, rid in enumerate(ids):
            child = sampling if n == 1 else replace(
                sampling, n=1, seed=None if sampling.seed is None else sampling.seed + index)
            req = Request(rid, prompt, child, arrival_seq=next(self._arrivals), arrival_time=self._clock(),
                          parent_id=request_id, index=index, extra_keys=extra_keys, span_keys=span_keys,
                          images=images, adapter=adapter, grammar=grammar)
            self.scheduler.add(req)
        self._choices[request_id] = ids

    def abort(self, request_id: str) -> bool:
        """Abort every unfinished choice of an API request, in any state. False if none was left.
        Their final outputs (finish_reason "abort") come with the next step()."""
        found = False
        for rid in self._choices.get(request_id, ()):
            out = self.scheduler.abort(rid)
            if out is not None:
                self._pending.append(out)
                found = True
        return found

    def finish(self, request_id: str, index: int = 0, reason: str = "stop") -> bool:
        """End one choice from above, e.g. when its text hit a stop string. False if already ended."""
        ids = self._choices.get(request_id, ())
        if not 0 <= index < len(ids):
            return False
        out = self.scheduler.finish(ids[index], reason)
        if out is not None:
            self._pending.append(out)
        return out is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- stepping -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the runner once (if anything is scheduled), apply the result.

        Returns outputs for choices that got a token or finished. A request the
        runner refused (StepOutput.failed) finishes with "error" alone; the step's
        other requests go on. If the runner raises (or answers off-contract), every
        request of that step finishes with "error" and step_error says why; either
        way their blocks and leases are returned and other requests carry on.
        """
        outputs, self._pending = self._pending, []
        self.step_error = None
        plan, failed = self.scheduler.schedule()
        outputs.extend(failed)
        if plan.scheduled:
            plan.step.finished_request_ids = self.scheduler.take_finished_ids()
            try:
                if self.num_steps + 1 == self._fault_at_step:
                    raise RuntimeError(f"injected fault at engine step {self._fault_at_step}")
                result = self.runner.execute(plan.step)
                self.scheduler.check_step_output(plan, result)
            except Exception as exc:  # noqa: BLE001 - a runner failure must not take the engine down
                ids = [req.request_id for req, _ in plan.scheduled]
                log.exception("runner failed; failing requests %s", ids)
                self.step_error = f"engine step failed: {type(exc).__name__}: {exc}"
                outputs.extend(self.scheduler.fail(plan, self.step_error))
            else:
                for rid, why in result.failed.items():
                    log.warning("request %s failed in the runner: %s", rid, why)
                outputs.extend(self.scheduler.update(plan, result))
            self.num_steps += 1
        self._forget_finished(outputs)
        return outputs

    def use_leases(self, leases: Leases) -> None:
        """Lease adapter slots through `leases` from now on (set-up: only while nothing is queued)."""
        if self.scheduler.requests:
            raise RuntimeError("leases are set before any request is added")
        self.scheduler.leases = leases

    def inject_fault(self, step: int) -> None:
        """Testing hook (--fault-fail-at-step): the runner call of engine step `step` (counted from 1)
        raises instead of running, exactly as a failing forward would: every request of that step
        finishes with "error" and step_error is set. 0 disarms it."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"fault step must be a non-negative int, got {step!r}")
        log.warning("fault injection %s", f"armed: engine step {step} will raise" if step else "off")
        self._fault_at_step = step

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            ids = self._choices.get(out.request_id)
            if out.finished and ids is not None and not any(i in self.scheduler.requests for i in ids):
                del self._choices[out.request_id]

    # -- observing ------------------------------------------------------------

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_total_blocks, kv_usage=kv.usage,
            num_preemptions=self.scheduler.num_preemptions, prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits, num_steps=self.num_steps,
            num_draft_tokens=self.scheduler.num_draft_tokens, num_accepted_tokens=self.scheduler.num_accepted_tokens,
            num_verifications=self.scheduler.num_verifications)

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request in any state and return their final outputs ("abort"): blocks and
        leases go back at once. For a server that stops serving."""
        outputs, self._pending = self._pending, []
        outputs.extend(out for rid in list(self.scheduler.requests)
                       if (out := self.scheduler.abort(rid)) is not None)
        self._choices.clear()
        return outputs

    def requests_per_adapter(self) -> tuple[dict[str, int], dict[str, int]]:
        """(running, waiting): adapter name -> how many of its requests (choices) are in each state.
        Base-model requests are not counted."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for counts, queue in ((running, self.scheduler.running), (waiting, self.scheduler.waiting)):
            for req in queue:
                if req.adapter is not None:
                    counts[req.adapter.name] = counts.get(req.adapter.name, 0) + 1
        return running, waiting

    def check_idle(self) -> None:
        """Raise unless nothing is queued or held: every block free, no request left (tests, drain)."""
        if self.has_unfinished() or self.scheduler.requests or self._choices:
            raise RuntimeError(f"engine not idle: {sorted(self.scheduler.requests)} {sorted(self._choices)}")
        self.scheduler.kv.check_idle()
