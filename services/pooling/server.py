"""Start the pooling service: bind (health NOT_SERVING), load models off the event loop,
start one batcher per model sharing one forward thread, then report SERVING.

When a batcher dies (services/pooling/batcher.py, failure policy) the whole service
reports NOT_SERVING on every name and every batcher stops: they share the device."""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from services.common.pb import pooling_pb2_grpc
from services.common.server import Server, ServerConfig, Started

from .batcher import Batcher, BatchLimits
from .config import PoolingConfig
from .folder import read_spec
from .heap import Heap
from .metrics import PoolingMetrics
from .model import Embedder, Reranker
from .servicer import SERVICE_NAME, PoolingServicer, Served

log = logging.getLogger("tessera.pooling")


def load_models(cfg: PoolingConfig) -> list:
    """[(spec, runner)] for the configured folders (blocking; run it in a thread)."""
    spec = read_spec(cfg.embedding_model, name=cfg.embedding_name, kind="embedding",
                     pooling=cfg.pooling, normalize=cfg.normalize, max_model_len=cfg.max_model_len)
    loaded = [(spec, Embedder(spec, dtype=cfg.dtype, fast=cfg.packed, fast_paths=cfg.fast_paths,
                                      matmul_precision=cfg.matmul_precision))]
    if cfg.reranker_model:
        rspec = read_spec(cfg.reranker_model, name=cfg.reranker_name, kind="rerank",
                          max_model_len=cfg.max_model_len)
        if rspec.name == spec.name:
            raise ValueError(f"embedding and reranker are both named {spec.name!r}; "
                             "set --embedding-name or --reranker-name")
        loaded.append((rspec, Reranker(rspec, dtype=cfg.dtype)))
    return loaded


@dataclass
class PoolingServer:
    """A running pooling service. `loaded` finishes when models are served (or failed)."""

    server: Server
    servicer: PoolingServicer
    metrics: PoolingMetrics
    executor: ThreadPoolExecutor
    port: int = 0
    loaded: asyncio.Task | None = field(default=None, repr=False)

    async def stop(self, grace: float | None = None) -> None:
        """Drain in-flight calls, then stop the batchers and the forward thread."""
        if self.loaded and not self.loaded.done():
            self.loaded.cancel()
        await self.server.stop(grace)
        await asyncio.gather(*(s.batcher.close() for s in self.servicer.models.values()))
        self.executor.shutdown(wait=True)


def fault_at_forward(at: int) -> Callable[[Callable], Callable]:
    """--fault-fail-at-forward: wrap each model's forward so that forward `at`, counted over
    every model on the device, raises (fault tests drive a real process this way)."""
    count = itertools.count(1)
    log.warning("fault injection armed: forward %d will raise", at)

    def wrap(run: Callable) -> Callable:
        def run_or_fail(seqs):
            if next(count) == at:
                raise RuntimeError(f"injected fault at forward {at}")
            return run(seqs)
        return run_or_fail
    return wrap


def checked_heap(heap: Heap, executor: ThreadPoolExecutor) -> Callable[[Callable], Callable]:
    """Wrap each model's forward so that a heap check (a trim, when due) runs in the forward thread right
    after it: queued behind the forward, it delays the next forward, never this one's answer."""
    def wrap(run: Callable) -> Callable:
        def run_then_check(seqs):
            rows = run(seqs)
            try:
                executor.submit(heap.check)
            except RuntimeError:
                pass   # the executor is shutting down (stop() after this forward began): nothing to bound
            return rows
        return run_then_check
    return wrap


async def _stop_serving(handle: PoolingServer, reason: str) -> None:
    """A batcher died: NOT_SERVING on every name first, then stop every batcher on the device."""
    await handle.server.set_serving(False)
    for served in handle.servicer.models.values():
        served.batcher.fail(reason)


async def _load(handle: PoolingServer, cfg: PoolingConfig) -> None:
    limits = BatchLimits(cfg.max_batch_size, cfg.max_batch_tokens, cfg.max_wait_ms, cfg.max_queue,
                         cfg.max_passes)
    # On the forward thread: torch work on a second long-lived thread would throttle both (services/common/compute.py).
    loaded = await asyncio.get_running_loop().run_in_executor(handle.executor, load_models, cfg)
    wrappers = [fault_at_forward(cfg.fault_fail_at_forward)] if cfg.fault_fail_at_forward else []
    heap = Heap(cfg.heap_growth_mb << 20)
    if heap.available and cfg.heap_growth_mb:
        wrappers.append(checked_heap(heap, handle.executor))
    elif cfg.heap_growth_mb:
        log.warning("--heap-growth-mb is not enforced here: it needs glibc's malloc_trim and /proc")

    def armed(run: Callable) -> Callable:
        for wrap in wrappers:
            run = wrap(run)
        return run
    on_failure = functools.partial(_stop_serving, handle)
    models = {}
    for spec, runner in loaded:
        batcher = Batcher(spec.name, armed(runner.forward), limits, handle.executor, handle.metrics, on_failure)
        batcher.start()
        models[spec.name] = Served(spec, runner, batcher)
        handle.servicer.defaults[spec.kind] = spec.name
    handle.servicer.models = models
    await handle.server.ready()   # freezes start-up's objects out of the collector's walks (Server.ready)
    log.info("serving %s on port %d", ", ".join(models), handle.port)


async def start_server(server_cfg: ServerConfig, cfg: PoolingConfig, *, wait: bool = True) -> PoolingServer:
    """Bind and start loading. wait=True returns once SERVING (raising if loading failed);
    wait=False returns right after binding, with health NOT_SERVING until `loaded` ends."""
    metrics = PoolingMetrics()
    servicer = PoolingServicer(metrics, cfg.max_request_inputs)
    server = Server(server_cfg, lambda s: pooling_pb2_grpc.add_PoolingServiceServicer_to_server(servicer, s),
                    [SERVICE_NAME], registry=metrics.registry)
    # One thread: one forward at a time on the device, never on the event loop.
    handle = PoolingServer(server, servicer, metrics, ThreadPoolExecutor(1, thread_name_prefix="forward"))
    handle.port = await server.start()
    handle.loaded = asyncio.get_running_loop().create_task(_load(handle, cfg))
    if wait:
        try:
            await handle.loaded
        except BaseException:
            await handle.stop(0)
            raise
    return handle


async def launch(server_cfg: ServerConfig, cfg: PoolingConfig) -> Started:
    """`start_server` for the shared process start-up (services/common/process.py): closing stops the
    batchers and the forward thread once the server has drained."""
    handle = await start_server(server_cfg, cfg)
    return Started(handle.server, functools.partial(handle.stop, 0))
