"""Adapters loaded on first use, by name, from --lora-root (--lora-on-demand), as LoRAX and vLLM's
filesystem resolver do: a Generate naming an adapter nobody registered loads --lora-root/NAME.

Who runs what (as for LoadAdapter, services/decoder/server/adapters.py):
- resolving, reading and validating the folder runs on a thread of its own (compute.in_own_thread),
  never on the event loop or the engine thread; at most MAX_LOADS loads run at once, so a burst of
  cold names holds at most that many adapters' weights in flight, and as many threads;
- registering it (and evicting to make room) runs on the engine thread through AsyncEngine.call,
  between two steps;
- requests for a cold adapter wait here, on the event loop, before the engine sees them: they hold no
  batch slot, KV block or lease, and requests on registered adapters pass them by.
Requests naming one cold adapter share one load (one task per name). A failed load fails those
requests only, and is not remembered: the next request tries again (the folder may have been fixed).

Eviction: when the registry refuses a new name (Overloaded: --max-cpu-loras reached), the least
recently used adapter that was loaded on demand and that no request names is unregistered, and the
registration tried again. Adapters from --lora or LoadAdapter are never evicted: an operator chose
them, and their folder need not be reachable by their name. A request pins its adapter's name from
before the lookup until its stream ends, under `_lock`, which the engine thread holds while it picks
and unregisters a victim: a name a request looked up is never evicted before that request holds its
lease, nor while it waits in the queue.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from services.common import compute
from services.common.errors import AdapterNotFound, InvalidArgument, Overloaded, TesseraError, Unsupported
from services.common.metrics import LATENCY_BUCKETS
from services.decoder.engine.request import AdapterRef
from services.decoder.lora import AdapterRegistry, AdapterStatus, LoraWeights
from services.decoder.lora.leases import adapter_request
from services.decoder.lora.peft_loader import CONFIG_FILE
from services.decoder.lora.registry import check_name
from services.decoder.server.async_engine import AsyncEngine

log = logging.getLogger("tessera.decoder.lora")

# Loads at once: each holds one adapter's host weights and a thread while it reads; reading is
# mostly file and memory bandwidth, so more would mostly share the same disk.
MAX_LOADS = 2

_LOADS = Counter("tessera_decoder_adapter_on_demand_loads", "adapters looked up in --lora-root on first use, "
                 "by result (loaded, not_found, invalid, full, error)", ["result"])
_LOADING = Gauge("tessera_decoder_adapter_on_demand_loading", "on-demand adapter loads in progress")
_EVICTED = Counter("tessera_decoder_adapter_on_demand_evictions",
                   "on-demand adapters unregistered to make room for another")
_LOAD_SECONDS = Histogram("tessera_decoder_adapter_load_seconds", "time to resolve, read, validate and register "
                          "an adapter loaded on demand", buckets=LATENCY_BUCKETS)


@dataclass
class _Loaded:
    """An adapter this loader registered. used: tick of its last pin or unpin (LRU order)."""

    digest: str
    used: int


def _check_name(name: str) -> None:
    """check_name, for the request's `model` (the name is the request's, not a load call's)."""
    try:
        check_name(name)
    except InvalidArgument as exc:
        raise InvalidArgument(exc.message, param="model") from None


def _result(exc: TesseraError) -> str:
    """The load counter's label for a failed load."""
    if isinstance(exc, AdapterNotFound):
        return "not_found"
    if isinstance(exc, Overloaded):
        return "full"
    return "invalid" if isinstance(exc, InvalidArgument | Unsupported) else "error"


class OnDemand:
    """Resolves a Generate's adapter name to (adapter, extra_keys), loading it when enabled.

    resolve(name) -> folder inside --lora-root (adapters.Adapters.resolve_path); read(folder) ->
    validated weights (any thread); on_change() exports the registry's metrics (engine thread).
    """

    def __init__(self, registry: AdapterRegistry, engine: AsyncEngine, *, enabled: bool,
                 resolve: Callable[[str], Path], read: Callable[[Path], LoraWeights],
                 on_change: Callable[[], None]):
        self.registry = registry
        self.engine = engine
        self.enabled = enabled
        self.resolve = resolve
        self.read = read
        self.on_change = on_change
        self._lock = threading.Lock()            # pins + _loaded, shared by the event loop and the engine thread
        self._pins: dict[str, int] = {}          # name -> requests naming it now
        self._loaded: dict[str, _Loaded] = {}    # names this loader registered (eviction candidates)
        self._tick = itertools.count(1)
        self._loading: dict[str, asyncio.Task] = {}   # name -> its load in flight (event loop only)
        self._slots: asyncio.Semaphore | None = None  # made on the loop, at the first load

    # -- requests (event loop) ----------------------------------------------------------

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[tuple[AdapterRef, tuple]]:
        """(adapter, extra_keys) for a request naming adapter `name`, loaded first when it is not
        registered (and loading is on; else AdapterNotFound). The name cannot be evicted until the
        block exits."""
        with self._lock:
            self._pins[name] = self._pins.get(name, 0) + 1
            self._touch(name)
            entry = self.registry.entries.get(name)
            digest = entry.digest if entry is not None else None
        try:
            if digest is None:
                digest = await self._cold(name)
            yield adapter_request(name, digest)
        finally:
            with self._lock:
                self._pins[name] -= 1
                if not self._pins[name]:
                    del self._pins[name]
                self._touch(name)

    def check(self, name: str) -> None:
        """AdapterNotFound unless `name` is registered or (loading on) could be loaded by name: for calls
        that only need it to exist (Tokenize runs the base tokenizer). Stats a folder; reads nothing."""
        if name in self.registry.entries:
            return
        if not self.enabled:
            raise AdapterNotFound(f"adapter {name!r} is not loaded", param="model")
        self._folder(name)

    def forget(self, name: str) -> None:
        """`name` was registered by an operator (LoadAdapter): it is no eviction candidate any more.
        Engine thread, with the registration."""
        with self._lock:
            self._loaded.pop(name, None)

    def _touch(self, name: str) -> None:
        loaded = self._loaded.get(name)
        if loaded is not None:
            loaded.used = next(self._tick)

    async def _cold(self, name: str) -> str:
        """The digest `name` was registered with, after the load it shares with the other requests for it."""
        if not self.enabled:
            raise AdapterNotFound(f"adapter {name!r} is not loaded", param="model")
        _check_name(name)
        task = self._loading.get(name)
        if task is None or task.done():
            task = asyncio.ensure_future(self._load(name))
            self._loading[name] = task
            task.add_done_callback(functools.partial(self._finished, name))
        # Shielded: a caller that goes away must not cancel a load other requests share.
        return await asyncio.shield(task)

    def _finished(self, name: str, task: asyncio.Task) -> None:
        if self._loading.get(name) is task:
            del self._loading[name]
        if not task.cancelled():
            task.exception()      # retrieved: every waiter may have gone; the load logged it already

    async def _load(self, name: str) -> str:
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_LOADS)
        async with self._slots:
            _LOADING.inc()
            start = time.monotonic()
            try:
                weights = await compute.in_own_thread(self._read, name)
                status = await self.engine.call(functools.partial(self._install, name, weights))
            except TesseraError as exc:
                _LOADS.labels(_result(exc)).inc()
                log.warning("on-demand load of adapter %s failed: %s", name, exc.message)
                raise
            finally:
                _LOADING.dec()
        took = time.monotonic() - start
        _LOAD_SECONDS.observe(took)
        _LOADS.labels("loaded").inc()
        log.info("loaded adapter %s on demand in %.0f ms: rank %d on %s, slot %d, digest %s", name, took * 1e3,
                 status.rank, ",".join(status.targets), status.slot, status.digest[:12])
        return status.digest

    # -- the load's own thread ------------------------------------------------------------

    def _folder(self, name: str) -> Path:
        """--lora-root/name, confined as LoadAdapter's paths are, holding a PEFT config."""
        _check_name(name)
        try:
            folder = self.resolve(name)
        except InvalidArgument:
            raise InvalidArgument(f"adapter {name!r} resolves outside the adapter root; only folders inside "
                                  f"--lora-root load on demand", param="model") from None
        except AdapterNotFound:
            folder = None
        if folder is None or not (folder / CONFIG_FILE).is_file():
            raise AdapterNotFound(f"adapter {name!r} is not loaded, and the adapter root holds no adapter folder "
                                  f"{name!r} to load it from", param="model")
        return folder

    def _read(self, name: str) -> LoraWeights:
        folder = self._folder(name)
        try:
            return self.read(folder)
        except TesseraError as exc:
            raise type(exc)(f"adapter {name!r} cannot be loaded from the adapter root: {exc.message}",
                            param="model") from None

    # -- the engine thread ------------------------------------------------------------------

    def _install(self, name: str, weights: LoraWeights) -> AdapterStatus:
        """Register `name`, evicting idle on-demand adapters while the registry is full."""
        reg = self.registry
        if name in reg.entries:        # registered meanwhile (LoadAdapter): keep the operator's
            return reg.status(name)
        while True:
            try:
                status = reg.register(name, weights)
                break
            except Overloaded:
                victim = self._evict()
                if victim is None:
                    raise Overloaded(f"adapter {name!r} cannot be loaded: the adapter registry is full "
                                     f"({reg.max_cpu_loras} adapters, --max-cpu-loras) and every adapter loaded "
                                     f"on demand is in use", param="model") from None
                _EVICTED.inc()
                log.info("evicted adapter %s (loaded on demand, least recently used) to load %s", victim, name)
        with self._lock:
            self._loaded[name] = _Loaded(status.digest, next(self._tick))
        self.on_change()
        return status

    def _evict(self) -> str | None:
        """Unregister the least recently used on-demand adapter that no request names; its name, or None."""
        reg = self.registry
        with self._lock:
            for gone in [n for n, lo in self._loaded.items()
                         if n not in reg.entries or reg.entries[n].digest != lo.digest]:
                del self._loaded[gone]            # unloaded or replaced by an operator since
            idle = [(lo.used, n) for n, lo in self._loaded.items()
                    if not self._pins.get(n) and not reg.entries[n].refs]
            if not idle:
                return None
            victim = min(idle)[1]
            reg.unregister(victim)
            del self._loaded[victim]
            return victim
