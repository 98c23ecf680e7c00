"""The decoder service's LoRA side: adapter store + registry + leases through the engine, admin paths, metrics.

Who runs what:
- reading and validating a PEFT folder is slow file work: it runs off the event loop
  and off the engine thread (`read`), touching nothing shared;
- every registry mutation (register, unregister) and listing runs on the engine thread
  through AsyncEngine.call, between steps, as do the scheduler's acquire/release;
- a Generate only reads the name -> digest map (one dict lookup); the digest is checked
  again when the request leases its slot, so a concurrent reload can never run other
  weights under the request's cache identity.

Clients never name slots or arbitrary paths: runtime loads resolve inside --lora-root, those by
LoadAdapter and those of a Generate naming an adapter by its folder (--lora-on-demand, ondemand.py).
"""
from __future__ import annotations

import logging
from pathlib import Path

from prometheus_client import Gauge

from services.common.errors import AdapterNotFound, InvalidArgument, PermissionDenied
from services.common.pb import decoder_pb2
from services.decoder.lora import AdapterLeases, AdapterRegistry, AdapterStatus, LoraWeights, load_peft
from services.decoder.lora.pool import AdapterPool
from services.decoder.server.async_engine import AsyncEngine
from services.decoder.server.config import DecoderConfig
from services.decoder.server.ondemand import OnDemand

log = logging.getLogger("tessera.decoder.lora")

_RUNNING = Gauge("tessera_decoder_adapter_running_requests", "running requests per adapter", ["adapter"])
_WAITING = Gauge("tessera_decoder_adapter_waiting_requests", "waiting requests per adapter", ["adapter"])
_SLOTS = Gauge("tessera_decoder_adapter_slots", "adapter slots by state", ["state"])
_POOL_BYTES = Gauge("tessera_decoder_adapter_pool_bytes",
                    "the CPU adapter pool: bytes of placed adapters (used), of its arenas (allocated), its budget",
                    ["state"])
_REGISTERED = Gauge("tessera_decoder_adapters_registered", "adapters registered on the host")
_LEASES = Gauge("tessera_decoder_adapter_leases", "live adapter leases (requests holding a slot)")
_LOADS = Gauge("tessera_decoder_adapter_slot_loads", "adapter weights written into a slot so far")
_EVICTIONS = Gauge("tessera_decoder_adapter_evictions", "slot fills that evicted another (idle) adapter so far")


class Adapters:
    """LoRA for one loaded decoder. Install once, before the engine starts."""

    def __init__(self, cfg: DecoderConfig, engine: AsyncEngine):
        self.bank = engine.install_adapters(cfg.lora_targets, cfg.max_loras, cfg.max_lora_rank,
                                            int(cfg.lora_memory_gb * 2**30))
        self.registry = AdapterRegistry(self.bank, cfg.max_cpu_loras)
        self.leases = AdapterLeases(self.registry)
        engine.use_leases(self.leases)
        self.root: Path | None = None
        if cfg.lora_root:
            root = Path(cfg.lora_root)
            if not root.is_dir():
                raise ValueError(f"--lora-root {cfg.lora_root!r} is not a directory")
            self.root = root.resolve()
        self._seen: set[str] = set()
        # Generate's door to names: registered ones, else (--lora-on-demand) --lora-root/NAME loaded on first use.
        self.on_demand = OnDemand(self.registry, engine, enabled=cfg.lora_on_demand, resolve=self.resolve_path,
                                  read=self.read, on_change=self.export_registry)
        for name, folder in cfg.preload_adapters:
            # Operator-given paths (flags), so not confined to --lora-root.
            status = self.registry.register(name, self.read(Path(folder)))
            log.info("preloaded adapter %s from %s: rank %d on %s, slot %d, digest %s", name, folder,
                     status.rank, ",".join(status.targets), status.slot, status.digest[:12])
        log.info("LoRA: backend %s, %s on %s, up to %d registered, root %s%s", self.bank.backend,
                 self.bank.describe(), ",".join(self.bank.targets), cfg.max_cpu_loras,
                 self.root or "(runtime loads disabled)", ", loaded on demand by name" if cfg.lora_on_demand else "")
        self.export_registry()

    # -- loading ------------------------------------------------------------------

    def read(self, folder: Path) -> LoraWeights:
        """Validate a PEFT folder into host weights (any thread; writes nothing shared)."""
        return load_peft(folder, layers=self.bank.shapes, max_rank=self.bank.max_rank, dtype=self.bank.dtype,
                         fused=self.bank.fused)

    def resolve_path(self, path: str) -> Path:
        """`path` inside --lora-root, symlinks and `..` resolved. PermissionDenied when runtime
        loads are disabled, InvalidArgument when the path escapes the root (proto contract),
        AdapterNotFound when the folder is missing."""
        if self.root is None:
            raise PermissionDenied("runtime adapter loading is disabled: start the decoder with --lora-root DIR",
                                   param="lora_path")
        if not path or "\x00" in path:
            raise InvalidArgument("lora_path must be a folder name inside the adapter root", param="lora_path")
        resolved = (self.root / path).resolve()
        if resolved != self.root and not resolved.is_relative_to(self.root):
            raise InvalidArgument(f"lora_path {path!r} resolves outside the adapter root; only folders "
                                  f"inside --lora-root can be loaded", param="lora_path")
        if not resolved.is_dir():
            raise AdapterNotFound(f"adapter folder {path!r} does not exist in the adapter root", param="lora_path")
        return resolved

    # -- metrics (engine thread) -------------------------------------------------------

    def export(self, engine: AsyncEngine) -> None:
        """Per-adapter running / waiting requests and slot state, after each step."""
        running, waiting = engine.requests_per_adapter()
        for name in self._seen - set(running) - set(waiting):
            _RUNNING.labels(name).set(0)
            _WAITING.labels(name).set(0)
        for name in set(running) | set(waiting):
            _RUNNING.labels(name).set(running.get(name, 0))
            _WAITING.labels(name).set(waiting.get(name, 0))
        self._seen = set(running) | set(waiting)
        self.export_registry()

    def export_registry(self) -> None:
        r = self.registry
        _SLOTS.labels("leased").set(r.slots_leased)
        _SLOTS.labels("filled").set(r.slots_in_use)
        if self.bank.num_slots is not None:       # the CPU pool has no slot count
            _SLOTS.labels("total").set(self.bank.num_slots)
        if isinstance(self.bank, AdapterPool):
            _POOL_BYTES.labels("used").set(self.bank.used_bytes)
            _POOL_BYTES.labels("allocated").set(self.bank.nbytes)
            _POOL_BYTES.labels("budget").set(self.bank.budget)
        _REGISTERED.set(len(r.entries))
        _LEASES.set(r.total_refs)
        _LOADS.set(r.num_slot_loads)
        _EVICTIONS.set(r.num_evictions)


def adapter_info(status: AdapterStatus) -> decoder_pb2.AdapterInfo:
    return decoder_pb2.AdapterInfo(name=status.name, digest=status.digest, rank=status.rank,
                                   target_modules=list(status.targets), slot=status.slot, refs=status.refs)
