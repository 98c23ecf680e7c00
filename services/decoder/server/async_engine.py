"""The engine loop off the asyncio event loop: one thread steps the core, one async stream per request.

The core is not thread-safe, so every call into it (add, abort, finish, step)
happens on the engine thread; the event loop talks to it through a command
queue and gets outputs back through call_soon_threadsafe, batched per step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.common.errors import InvalidArgument, TesseraError, Unavailable
from services.decoder.engine.engine_core import EngineCore
from services.decoder.engine.output import EngineStats, RequestOutput
from services.decoder.engine.step import SamplingParams

log = logging.getLogger("tessera.decoder.loop")

_FAILED = object()   # sentinel pushed to every stream when the engine dies


class AsyncEngine:
    """Owns the engine thread. `on_step(stats, outputs)` runs on that thread after each step.

    A step that fails (the runner raised) kills the engine: every in-flight request
    fails, their blocks and leases are returned, new requests get UNAVAILABLE and
    `on_failure(reason)` runs on the event loop.
    """

    def __init__(self, core: EngineCore, on_step: Callable[[EngineStats, list[RequestOutput]], None] | None = None,
                 on_failure: Callable[[str], None] | None = None):
        self.core = core
        self.on_step = on_step
        # Called on the event loop once, when the engine dies (health -> NOT_SERVING).
        self.on_failure = on_failure
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
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
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.failed is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The counters as of the last step (read without touching the core)."""
        return self._stats

    # -- requests ---------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *,
                       extra_keys: tuple = (), span_keys: tuple = (), features: dict[str, Any] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs (all choices interleaved) until every choice finished.

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
        self._commands.put(("add", request_id, prompt_ids, sampling, extra_keys, span_keys, features, accepted))
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
                self._commands.put(("abort", request_id))

    def finish(self, request_id: str, index: int, reason: str = "stop") -> None:
        """End one choice early (a stop string was seen in its text)."""
        self._commands.put(("finish", request_id, index, reason))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread between two steps and return its result.

        For state the engine thread also touches (the adapter registry and its device
        slots): run there, a mutation can never interleave with a step. fn's exception
        is re-raised here; the engine keeps running.
        """
        if not self.alive:
            raise Unavailable(f"engine is not running: {self.failed or 'stopped'}")
        done = self._loop.create_future()
        self._commands.put(("call", fn, done))
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
                    errors = [o.error for o in outputs if o.finish_reason == "error"]
                    if errors:
                        # A forward that raised leaves the device in an unknown state: stop
                        # serving rather than keep answering from it (restart the process).
                        self._die(f"engine step failed: {errors[0]}", outputs)
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
        for rid in list(self.core.scheduler.requests):
            self.core.scheduler.abort(rid)
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

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, sampling, extra_keys, span_keys, features, accepted = cmd
            try:
                self.core.add_request(rid, prompt, sampling, extra_keys=extra_keys, span_keys=span_keys,
                                      features=features)
            except TesseraError as exc:
                self._loop.call_soon_threadsafe(_settle, accepted, exc)
            else:
                self._loop.call_soon_threadsafe(_settle, accepted, None)
        elif kind == "abort":
            self.core.abort(cmd[1])
        elif kind == "finish":
            self.core.finish(cmd[1], cmd[2], cmd[3])
        elif kind == "call":
            _, fn, done = cmd
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine must stay up
                if not isinstance(exc, TesseraError):
                    log.exception("engine-thread call failed")
                self._loop.call_soon_threadsafe(_settle, done, exc)
            else:
                self._loop.call_soon_threadsafe(_settle_value, done, result)

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
