"""The adapter bank: resident device slots for LoRA weights, installed on a CausalLM (the CUDA store).

Slots are storage only. Which adapter a slot holds, who leases it and when it may be
refilled is the registry's business (lora/registry.py); the bank writes and clears
slots and, for the duration of one forward, publishes the step's row grouping.

It implements the store interface (lora/store.py): a handle is a slot number, `place` fills the
first empty slot (None when every slot is filled) and `free` clears one. The CPU service uses
the adapter pool (lora/pool.py) instead; the bank still runs on CPU with its torch path.

Every write goes through `write(slot, weights)` with LoraWeights that
`prepare_weights` already validated against `shapes`, so a write cannot fail halfway
for a reason the caller could have caught.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from services.common.errors import Unsupported
from services.decoder.kernels.lora import backend_name
from services.decoder.kernels.lora_meta import LoraBatchMeta, build_lora_meta
from services.decoder.lora.layer import LoraSlots, LoraStep
from services.decoder.lora.store import RowSpan
from services.decoder.lora.weights import TARGETS, LoraWeights, leaf
from services.decoder.model.linear import Linear

# CPU: use the padded per-slot form (lora/layer.py) when rows * slots * rank is at most this
# (decode-shaped steps), or when the rows are spread evenly enough over the slots (`_balanced`);
# 0: never. It runs every slot as one batched GEMM pair over the rows padded to the busiest
# slot's count (5 calls per projection whatever the number of adapters), where the per-segment
# path makes 2 calls per segment; a chunk dominated by one adapter takes that path.
DENSE_MAX_WORK = 8192


class AdapterBank:
    """num_slots device slots of rank max_rank on the `targets` projections of `model`.

    layers: module name -> LoraSlots (installed on every target projection of every layer).
    step: the LoraStep every wrapped layer reads; `activate` fills it for one forward
    with adapter rows (otherwise its meta is None and the layers do base work only).
    """

    def __init__(self, model: nn.Module, targets: Sequence[str] = TARGETS, num_slots: int = 4,
                 max_rank: int = 16):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown or not targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {', '.join(TARGETS)}; got {list(targets)}")
        declined = getattr(model, "refused_features", dict)().get("lora")
        if declined:
            raise Unsupported(f"LoRA adapters: {declined} (serve this model with --max-loras 0)", param="max_loras")
        if num_slots < 1 or max_rank < 1:
            raise ValueError("the adapter bank needs at least one slot and a rank of at least 1")
        if any(isinstance(m, Linear) and m.lora is not None for m in model.modules()):
            raise ValueError("an adapter bank is already installed on this model")
        self.num_slots, self.max_rank, self.targets = num_slots, max_rank, tuple(t for t in TARGETS if t in targets)
        self.layers: dict[str, LoraSlots] = {}
        projections = [(name, m) for name, m in model.named_modules()
                       if leaf(name) in self.targets and isinstance(m, Linear)]
        if not projections:
            raise ValueError(f"the model has no projections named {', '.join(self.targets)}")
        self.device, self.dtype = projections[0][1].weight.device, projections[0][1].weight.dtype
        self.backend = backend_name(self.device)
        self.step = LoraStep(self.backend)
        for name, module in projections:
            self.layers[name] = LoraSlots.install(module, self.step, num_slots, max_rank)
        self.dense_max_work = DENSE_MAX_WORK if self.backend == "torch" else 0
        # The family's checkpoint_fused (model/decoder.py): the names its adapters give fused projections.
        self.fused: dict[str, tuple[str, ...]] = dict(getattr(model, "checkpoint_fused", {}))
        self.filled = [False] * num_slots          # which slots hold an adapter (write / clear)

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """module name -> (in_features, out_features), what prepare_weights checks against."""
        return {name: (m.in_features, m.out_features) for name, m in self.layers.items()}

    @property
    def nbytes(self) -> int:
        return sum(m.lora_A.numel() * m.lora_A.element_size() + m.lora_B.numel() * m.lora_B.element_size()
                   for m in self.layers.values())

    def describe(self) -> str:
        return f"{self.num_slots} slots of rank {self.max_rank} ({self.nbytes / 2**20:.1f} MiB)"

    def refusal(self, weights: LoraWeights) -> str | None:
        return None      # prepare_weights already bounded the rank: any adapter fits an empty slot

    # -- slots ------------------------------------------------------------------

    def place(self, weights: LoraWeights) -> int | None:
        """Write `weights` into the first empty slot; that slot, or None when all are filled."""
        slot = next((s for s, used in enumerate(self.filled) if not used), None)
        if slot is not None:
            self.write(slot, weights)
        return slot

    def would_fit(self, weights: LoraWeights, freed: list[int]) -> bool:
        return bool(freed) or not all(self.filled)

    def free(self, slot: int) -> None:
        self.clear(slot)

    def valid(self, slot: int) -> bool:
        return not isinstance(slot, bool) and isinstance(slot, int) and 0 <= slot < self.num_slots \
            and self.filled[slot]

    @torch.no_grad()
    def write(self, slot: int, weights: LoraWeights) -> None:
        """Fill `slot` with `weights` (validated by prepare_weights against self.shapes);
        modules the adapter does not cover, and ranks above its own, are zeroed."""
        self._check_slot(slot)
        if weights.rank > self.max_rank or set(weights.modules) - set(self.layers):
            raise ValueError("weights were not prepared for this bank")  # a caller bug, not user input
        r = weights.rank
        for name, layer in self.layers.items():
            layer.lora_A[slot].zero_()
            layer.lora_B[slot].zero_()
            pair = weights.modules.get(name)
            if pair is not None:
                layer.lora_A[slot, :r].copy_(pair[0])
                layer.lora_B[slot, :, :r].copy_(pair[1])
            layer.sync_slot(slot)
        self.filled[slot] = True

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        """Zero a slot (an emptied slot then adds exactly nothing if ever selected)."""
        self._check_slot(slot)
        for layer in self.layers.values():
            layer.lora_A[slot].zero_()
            layer.lora_B[slot].zero_()
            layer.sync_slot(slot)
        self.filled[slot] = False

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot!r} out of range for {self.num_slots} slots")

    # -- one forward ----------------------------------------------------------------

    @contextmanager
    def activate(self, spans: Sequence[RowSpan], num_rows: int) -> Iterator[LoraBatchMeta | None]:
        """Publish the step's grouping to every wrapped layer for one forward.

        spans: (first row, rows, slot) per chunk that uses an adapter; every other row
        is base only. With no spans nothing is built and the layers skip LoRA entirely.
        The meta is built once here and reused by all layers and projections.
        """
        step = self.step
        if step.meta is not None:
            raise RuntimeError("adapter bank activated twice (nested forwards)")
        if not spans:
            yield None
            return
        slots = torch.full((num_rows,), -1, dtype=torch.int64)
        for start, n, slot in spans:
            self._check_slot(slot)
            slots[start:start + n] = slot
        step.meta = build_lora_meta(slots, device=self.device, num_slots=self.num_slots)
        if self.dense_max_work and (num_rows * self.num_slots * self.max_rank <= self.dense_max_work
                                    or _balanced(spans, self.num_slots)):
            step.dense_index, step.dense_mask = _padded_slots(spans, self.num_slots, self.dtype, self.device)
        try:
            yield step.meta
        finally:
            step.meta = step.dense_index = step.dense_mask = None


def _balanced(spans: Sequence[RowSpan], num_slots: int) -> bool:
    """Whether padding every slot to the busiest one's row count at most doubles the adapter rows: then
    the padded form beats the per-segment GEMMs for prefill chunks too (2 threads, 512 rows over 8
    rank-16 slots: ~0.2 ms against ~1-2 ms per projection); a chunk dominated by one adapter keeps the
    segment path, where padding would multiply the work."""
    counts = [0] * num_slots
    for _, n, slot in spans:
        counts[slot] += n
    return num_slots * max(counts) <= 2 * sum(counts)


def _padded_slots(spans: Sequence[RowSpan], num_slots: int, dtype: torch.dtype, device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [S*L], keep [S, L, 1]): slot s's rows at index[s*L:(s+1)*L], L = the most rows any slot has.
    Padding positions gather row 0 and have keep 0, so they add exactly nothing; rows of no span (base
    only, slot -1) appear nowhere and get exactly zero correction."""
    rows: list[list[int]] = [[] for _ in range(num_slots)]
    for start, n, slot in spans:
        rows[slot].extend(range(start, start + n))
    width = max(len(r) for r in rows)
    index = torch.zeros((num_slots, width), dtype=torch.int64)
    keep = torch.zeros((num_slots, width, 1), dtype=dtype)
    for slot, members in enumerate(rows):
        if members:
            index[slot, :len(members)] = torch.tensor(members)
            keep[slot, :len(members)] = 1
    return index.view(-1).to(device), keep.to(device)
