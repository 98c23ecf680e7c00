"""What the registry and the runner need of an adapter store: the CUDA slot bank or the CPU pool.

A store holds adapter weights where the forward reads them and hands out a small integer
handle per placed adapter (the bank's slot number, the pool's reused id; ListAdapters reports
it as "slot"). Which content a handle holds, who leases it and what to evict is the registry's
business (lora/registry.py). Stores change only between forwards: `place` may move other
adapters' rows (the pool compacts and grows its arenas), which is safe because a step's row
positions are computed from the handles when it `activate`s (docs/design.md, invariant 5).
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from services.decoder.lora.weights import LoraWeights

# (first row in the step, number of rows, handle): one per chunk that uses an adapter.
RowSpan = tuple[int, int, int]


class AdapterStore(Protocol):
    backend: str                                  # GetModelInfo's lora_backend
    device: torch.device
    dtype: torch.dtype
    max_rank: int
    targets: tuple[str, ...]
    fused: dict[str, tuple[str, ...]]             # the family's checkpoint_fused, for load_peft
    layers: Mapping[str, object]                  # module name -> the `Linear.lora` installed on it

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """module name -> (in_features, out_features), what prepare_weights checks against."""

    @property
    def nbytes(self) -> int:
        """Bytes the store's buffers take now."""

    @property
    def num_slots(self) -> int | None:
        """Fixed slot count (the bank), or None where only bytes limit residency (the pool)."""

    def describe(self) -> str:
        """One line for the start-up log."""

    def refusal(self, weights: LoraWeights) -> str | None:
        """Why the store could never hold `weights` even empty, or None."""

    def place(self, weights: LoraWeights) -> int | None:
        """Write `weights` (prepared for this store) under a new handle; None when there is no room."""

    def would_fit(self, weights: LoraWeights, freed: list[int]) -> bool:
        """Whether `place(weights)` would succeed once the placed handles `freed` were freed."""

    def free(self, handle: int) -> None:
        """Forget a placed handle (no lease may hold it); the number may be handed out again."""

    def valid(self, handle: int) -> bool:
        """Whether `handle` is placed now."""

    def activate(self, spans: list[RowSpan], num_rows: int) -> AbstractContextManager:
        """Publish one forward's rows -> handles to every wrapped projection."""
