"""The engine loop off the asyncio event loop: one thread steps the core, one async stream per request.

The core is not thread-safe, so every call into it (add, abort, finish, step)
happens on the engine thread; the event loop talks to it through a queue of
typed commands and gets outputs back through call_soon_threadsafe, batched per
step. AsyncEngine is also the server's one door to what lies below it: what the
loaded model is (`describe`), the adapter bank and its per-adapter counts, the
fault-injection hook, and `abort_all`; the server never reaches the runner or
the scheduler.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgument, TesseraError, Unavailable
from services.common.plan import ExecutionPlan
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.output import EngineStats, RequestOutput
from services.decoder.engine.request import AdapterRef, SpanKey
from services.decoder.engine.scheduler import Leases
from services.decoder.engine.step import CompiledGrammar, PlacedImages, SamplingParams
from services.decoder.lora.bank import AdapterBank
from services.decoder.lora.pool import AdapterPool
from services.decoder.lora.store import AdapterStore
from services.decoder.model.config import ModelConfig
from services.decoder.runner.runner import Runner

log = logging.getLogger("tessera.decoder.loop")

_FAILED = object()   # sentinel pushed to every stream when the engine dies


# -- commands: the event loop -> the engine thread ----------------------------------------


@dataclass
class AddRequest:
    """Queue an API request; `accepted` settles with None, or the core's validation error."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    extra_keys: tuple
    span_keys: tuple[SpanKey, ...]
    images: PlacedImages | None
    adapter: AdapterRef | None
    grammar: CompiledGrammar | None
    accepted: asyncio.Future


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class FinishChoice:
    request_id: str
    index: int
    reason: str


@dataclass
class CallOnEngine:
    """Run fn() between two steps; `done` settles with its result or its exception."""

    fn: Callable[[], Any]
    done: asyncio.Future


@dataclass
class Wake:
    """Nothing to do: wakes a blocked engine thread (to see that it is stopping)."""


Command = AddRequest | AbortRequest | FinishChoice | CallOnEngine | Wake


@dataclass(frozen=True)
class EngineDescription:
    """What the loaded model and its runner are, for GetModelInfo and request checks (read at load).

    model: the model's config (vision, M-RoPE). plan: the runner's fast-path choices at load
    (services/common/plan.py); lora_backend is "" without an adapter bank.
    """

    model: ModelConfig
    vocab_size: int
    quantization: str
    plan: ExecutionPlan
    lora_backend: str = ""


class AsyncEngine:
    """Owns the engine thread. `on_step(stats, outputs)` runs on that thread after each step.

    A request the runner refuses (a request-level fault that got past the server's checks) fails
    alone, with finish_reason "error"; the engine serves on. A step whose runner call raised kills
    the engine: a forward that raised leaves the device in an unknown state, so every in-flight
    request fails, their blocks and leases are returned, new requests get UNAVAILABLE and
    `on_failure(reason)` runs on the event loop (restart the process).
    """

    def __init__(self, core: EngineCore, on_step: Callable[[EngineStats, list[RequestOutput]], None] | None = None,
                 on_failure: Callable[[str], None] | None = None):
        self.core = core
        self._runner: Runner = core.runner
        self.on_step = on_step
        # Called on the event loop once, when the engine dies (health -> NOT_SERVING).
        self.on_failure = on_failure
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failed: str | None = None     # why the engine thread died, if it did
        self._stats = core.stats()

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.failed is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The counters as of the last step (read without touching the core)."""
        return self._stats

    # -- what lies below (set-up before start, or fixed since load) ----------------

    def describe(self) -> EngineDescription:
        """The loaded model and its runner's load-time choices."""
        r = self._runner
        return EngineDescription(
            model=r.config, vocab_size=r.vocab_size, quantization=r.quantization, plan=r.plan,
            lora_backend=r.lora.backend if r.lora is not None else "")

    def install_adapters(self, targets: Sequence[str], num_slots: int, max_rank: int,
                         memory_bytes: int = 2**30) -> AdapterStore:
        """Before start: put an adapter store on the model's `targets` projections; the runner runs
        each chunk's lora_slot (a store handle) through it. On CUDA the bank of num_slots slots of
        rank max_rank; on CPU the pool of memory_bytes, ranks up to max_rank (num_slots unused)."""
        if self._thread is not None:
            raise RuntimeError("adapters are installed before the engine starts")
        model = self._runner.model
        bank: AdapterStore
        if self._runner.device.type == "cpu":
            bank = AdapterPool(model, targets, memory_bytes, max_rank)
        else:
            bank = AdapterBank(model, targets, num_slots, max_rank)
        self._runner.attach_lora(bank)
        return bank

    def use_leases(self, leases: Leases) -> None:
        """Before start: lease adapter slots to requests through `leases` (acquire at admission)."""
        if self._thread is not None:
            raise RuntimeError("leases are set before the engine starts")
        self.core.use_leases(leases)

    def requests_per_adapter(self) -> tuple[dict[str, int], dict[str, int]]:
        """(running, waiting) requests per adapter name. Engine thread only (on_step, `call`)."""
        return self.core.requests_per_adapter()

    def inject_fault(self, step: int) -> None:
        """Testing hook (--fault-fail-at-step): engine step `step` fails as a raising forward would,
        which kills the engine (see the class docstring). Before start."""
        self.core.inject_fault(step)

    # -- requests ---------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *,
                       extra_keys: tuple = (), span_keys: tuple[SpanKey, ...] = (), images: PlacedImages | None = None,
                       adapter: AdapterRef | None = None, grammar: CompiledGrammar | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs (all choices interleaved) until every choice finished.

        images, adapter and grammar are EngineCore.add_request's.

        Raises the core's typed validation error before anything is yielded.
        Leaving early (cancellation, an exception in the consumer) aborts the request.
        """
        if not self.alive:
            raise Unavailable(f"engine is not running: {self.failed or 'stopped'}")
        if request_id in self._streams:
            # Refused here, before its queue could replace the live request's.
            raise InvalidArgument(f"request id {request_id!r} is already in flight", param="request_id")
        stream: asyncio.Queue = asyncio.Queue()
        accepted = self._loop.create_future()
        self._streams[request_id] = stream
        self._commands.put(AddRequest(request_id, prompt_ids, sampling, extra_keys, span_keys, images, adapter, grammar,
                                      accepted))
        try:
            await accepted
            remaining = sampling.n
            while remaining:
                item = await stream.get()
                if item is _FAILED:
                    raise Unavailable(f"engine failed: {self.failed}")
                for out in item:
                    remaining -= out.finished
                    yield out
        finally:
            self._streams.pop(request_id, None)
            refused = accepted.done() and not accepted.cancelled() and accepted.exception() is not None
            if not refused:   # the add is queued or done: abort it (a no-op once finished)
                self._commands.put(AbortRequest(request_id))

    async def abort_all(self) -> int:
        """Abort every request in flight, between two steps: each stream ends with finish_reason
        "abort", every block and lease goes back. Returns how many choices were aborted."""
        def abort() -> int:
            outputs = self.core.abort_all()
            self._stats = self.core.stats()
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
            return len(outputs)
        return await self.call(abort)

    def finish(self, request_id: str, index: int, reason: str = "stop") -> None:
        """End one choice early (a stop string was seen in its text)."""
        self._commands.put(FinishChoice(request_id, index, reason))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread between two steps and return its result.

        For state the engine thread also touches (the adapter registry and its device
        slots): run there, a mutation can never interleave with a step. fn's exception
        is re-raised here; the engine keeps running.
        """
        if not self.alive:
            raise Unavailable(f"engine is not running: {self.failed or 'stopped'}")
        done = self._loop.create_future()
        self._commands.put(CallOnEngine(fn, done))
        return await done

    # -- the engine thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands(block=not self.core.has_unfinished())
                if self._stopping:
                    break
                if self.core.has_unfinished():
                    before = self.core.num_steps
                    outputs = self.core.step()
                    if not outputs and self.core.num_steps == before:
                        # Nothing could be scheduled (e.g. every waiting request needs an adapter
                        # slot that is leased): wait for a command instead of spinning.
                        self._drain_commands(block=True, timeout=0.01)
                    self._stats = self.core.stats()
                    if self.on_step is not None:
                        self.on_step(self._stats, outputs)
                    if self.core.step_error is not None:
                        # A forward that raised leaves the device in an unknown state: stop
                        # serving rather than keep answering from it (restart the process). A
                        # request the runner refused failed alone and is no reason to stop.
                        self._die(self.core.step_error, outputs)
                        return
                    if outputs:
                        self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except Exception as exc:  # noqa: BLE001 - the thread must report, not vanish
            log.exception("engine loop died")
            self._die(f"{type(exc).__name__}: {exc}")

    def _die(self, reason: str, outputs: list[RequestOutput] = ()) -> None:
        """Report the failure, then fail every in-flight request (the step's `outputs` first)
        and return their blocks and leases.

        The loop runs callbacks in the order they were scheduled, so health reads NOT_SERVING
        before any client can hear of the failure and ask.
        """
        self.failed = reason
        log.error("engine failed, no longer serving: %s", reason)
        if self.on_failure is not None:
            self._loop.call_soon_threadsafe(self.on_failure, reason)
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        self.core.abort_all()       # every block and lease back; the streams hear _FAILED instead
        self._stats = self.core.stats()
        self._loop.call_soon_threadsafe(self._fail_all)

    def _drain_commands(self, block: bool, timeout: float = 0.5) -> None:
        try:
            cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, AddRequest):
            try:
                self.core.add_request(cmd.request_id, cmd.prompt_ids, cmd.sampling, extra_keys=cmd.extra_keys,
                                      span_keys=cmd.span_keys, images=cmd.images, adapter=cmd.adapter,
                                      grammar=cmd.grammar)
            except TesseraError as exc:
                self._loop.call_soon_threadsafe(_settle, cmd.accepted, exc)
            else:
                self._loop.call_soon_threadsafe(_settle, cmd.accepted, None)
        elif isinstance(cmd, AbortRequest):
            self.core.abort(cmd.request_id)
        elif isinstance(cmd, FinishChoice):
            self.core.finish(cmd.request_id, cmd.index, cmd.reason)
        elif isinstance(cmd, CallOnEngine):
            try:
                result = cmd.fn()
            except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine must stay up
                if not isinstance(exc, TesseraError):
                    log.exception("engine-thread call failed")
                self._loop.call_soon_threadsafe(_settle, cmd.done, exc)
            else:
                self._loop.call_soon_threadsafe(_settle_value, cmd.done, result)
        elif not isinstance(cmd, Wake):
            raise TypeError(f"unknown engine command {cmd!r}")

    # -- on the event loop --------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        grouped: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            grouped.setdefault(out.request_id, []).append(out)
        for rid, outs in grouped.items():
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(outs)

    def _fail_all(self) -> None:
        for stream in self._streams.values():
            stream.put_nowait(_FAILED)


def _settle_value(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
