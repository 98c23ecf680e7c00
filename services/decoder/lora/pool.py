"""The CPU adapter store: adapters' rank rows packed into per-kind arenas under a byte budget.

No slots and no padding. For each target kind (q_proj ... down_proj) every layer holds one
arena, A [P_t, K] and Bt [P_t, N] in the serving dtype, with the same capacity P_t and the
same row layout in every layer of that kind. An adapter of rank r covering kinds {q, v}
takes r rows at one offset in the q arenas and r rows at one offset in the v arenas, nothing
in the others; a module of a covered kind that the adapter leaves out (PEFT's
layers_to_transform) gets zero rows. Rows are placed first fit; when no gap is large enough
the kind is compacted, or grown (reallocated, which also compacts). The bytes of placed
adapters never exceed the budget, and neither do the arenas together: a kind that must grow
past what the budget leaves first shrinks the others to their used rows.

All of this happens between forwards (the registry places on the engine thread), never
under a running step. Rows move, but a step's offsets are read from the handles when it
activates, so a lease holds a handle, not a position (docs/design.md, invariant 5).

For one forward `activate` publishes offsets [7, M] and ranks [7, M] int32 (row m of kind
t: the adapter rows it reads; rank 0 for base rows and for kinds its adapter does not
cover), which every wrapped projection's `PoolLayer.correct` passes to kernels/lora_cpu
`lora_rows` with its kind's row, and which the fused decode stack reads from `step`.
"""
from __future__ import annotations

import functools
import itertools
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from services.common import native
from services.common.plan import AUTO, PATHS, ExecutionPlan, Timing, pick
from services.decoder.kernels import lora_cpu
from services.decoder.lora.store import RowSpan
from services.decoder.lora.store import projections as wrapped
from services.decoder.lora.weights import TARGETS, LoraWeights, leaf
from services.decoder.model.linear import Linear

log = logging.getLogger("tessera.decoder.lora")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class PoolStep:
    """One forward's adapter rows, shared by every wrapped projection; empty between forwards.

    offsets, ranks [len(TARGETS), M] int32: row m of kind t reads arena rows
    [offsets[t, m], offsets[t, m] + ranks[t, m]); active[t]: some row of kind t has rank > 0.
    rows: the pool's lora_rows (the C++ operator, or its torch form where it cannot be built).
    """

    rows: Callable[..., torch.Tensor] = lora_cpu.lora_rows
    offsets: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    active: tuple[bool, ...] = (False,) * len(TARGETS)


class PoolLayer:
    """One projection's arena and its correction, hung on the Linear as `Linear.lora`.

    A [P, in_features], Bt [P, out_features]: the kind's rank rows (B transposed, scale folded
    in). The pool replaces both tensors when the kind grows or shrinks.
    """

    def __init__(self, name: str, linear: Linear, kind: int, step: PoolStep):
        weight = linear.weight
        self.name, self.kind, self.step = name, kind, step
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.A = torch.zeros((0, self.in_features), dtype=weight.dtype)
        self.Bt = torch.zeros((0, self.out_features), dtype=weight.dtype)
        match = _LAYER.search(name)
        self.layer = int(match.group(1)) if match else -1     # decoder layer index, -1 outside one

    @property
    def row_bytes(self) -> int:
        return (self.in_features + self.out_features) * self.A.element_size()

    def correct(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Base output y [M, out_features] of x [M, in_features] (possibly a fused projection's
        strided slice) plus each row's adapter rows; y itself when no row of the step uses this kind."""
        step = self.step
        if not step.active[self.kind]:
            return y
        # In place, into a fused projection's column slice too (the kernel takes any row stride): the
        # fused output then holds the corrected q and k, so the layer keeps its joint q|k path (model/layers.py)
        # and base rows of a step with adapters take exactly the path, and the bits, of a step without.
        if y.stride(-1) != 1:
            y = y.contiguous()
        return step.rows(y, x.contiguous(), self.A, self.Bt, step.offsets[self.kind], step.ranks[self.kind])


@dataclass
class KindRows:
    """The row allocation of one kind, shared by its layers. extents: handle -> (offset, rank)."""

    kind: int
    layers: list[PoolLayer]
    capacity: int = 0
    extents: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def row_bytes(self) -> int:
        """Bytes of one rank row across every layer of the kind."""
        return sum(layer.row_bytes for layer in self.layers)

    @property
    def used(self) -> int:
        return sum(r for _, r in self.extents.values())

    def first_fit(self, rank: int) -> int | None:
        cursor = 0
        for offset, r in sorted(self.extents.values()):
            if offset - cursor >= rank:
                return cursor
            cursor = offset + r
        return cursor if self.capacity - cursor >= rank else None

    @torch.no_grad()
    def repack(self, capacity: int) -> None:
        """Move every extent down to close the gaps, into new tensors of `capacity` rows when that
        differs from the current one (capacity >= used)."""
        order = sorted(self.extents.items(), key=lambda item: item[1][0])
        for layer in self.layers:
            if capacity != self.capacity:
                a = layer.A.new_zeros((capacity, layer.in_features))
                bt = layer.Bt.new_zeros((capacity, layer.out_features))
            else:
                a, bt = layer.A, layer.Bt
            cursor = 0
            for _, (offset, r) in order:
                if a is not layer.A or offset != cursor:
                    # A clone first: in place, the source and target ranges may overlap.
                    a[cursor:cursor + r] = layer.A[offset:offset + r].clone()
                    bt[cursor:cursor + r] = layer.Bt[offset:offset + r].clone()
                cursor += r
            layer.A, layer.Bt = a, bt
        cursor = 0
        for handle, (_, r) in order:
            self.extents[handle] = (cursor, r)
            cursor += r
        self.capacity = capacity


@dataclass(frozen=True)
class Placed:
    rank: int
    kinds: tuple[int, ...]     # TARGETS indices the adapter covers
    nbytes: int


def _rows_operator() -> Callable[..., torch.Tensor]:
    """lora_cpu's C++ operator, or its torch form (said in the log) where the operator cannot be built."""
    try:
        lora_cpu.load()
    except native.BuildError as e:
        log.warning("lora_cpu unavailable, adapter rows run in torch: %s", str(e).splitlines()[0])
        return lora_cpu.lora_rows_torch
    return lora_cpu.lora_rows


class AdapterPool:
    """The CPU adapter store over `model`'s `targets` projections (lora/store.py's interface).

    budget_bytes: most bytes of placed adapters (and of all arenas together); max_rank: the
    largest rank accepted (no padding to it). version: bumped whenever rows move or an arena
    tensor is replaced, so a holder of `arenas()` knows to read them again.
    """

    num_slots = None

    def __init__(self, model: nn.Module, targets: Sequence[str] = TARGETS, budget_bytes: int = 2**30,
                 max_rank: int = 16):
        if budget_bytes < 1 or max_rank < 1:
            raise ValueError("the adapter pool needs a positive byte budget and a rank of at least 1")
        self.targets, projections = wrapped(model, targets)
        self.budget, self.max_rank = budget_bytes, max_rank
        self.device, self.dtype = projections[0][1].weight.device, projections[0][1].weight.dtype
        if self.device.type != "cpu":
            raise ValueError("the adapter pool serves CPU models; use the adapter bank on CUDA")
        self.step = PoolStep(_rows_operator())
        self.backend = "cpu" if self.step.rows is lora_cpu.lora_rows else "torch"
        self.grain = lora_cpu.GRAINS["coarse"]  # the operator's least work per thread (choose_reading)
        self.prefetch = lora_cpu.PREFETCH[PATHS["lora_prefetch"][0]]  # how its blocks ask (choose_reading)
        self.layers: dict[str, PoolLayer] = {}
        self.kinds: dict[int, KindRows] = {}
        for name, module in projections:
            kind = TARGETS.index(leaf(name))
            module.lora = layer = PoolLayer(name, module, kind, self.step)
            self.layers[name] = layer
            self.kinds.setdefault(kind, KindRows(kind, [])).layers.append(layer)
        self.placed: dict[int, Placed] = {}
        self.used_bytes = 0
        self.version = 0
        self.fused: dict[str, tuple[str, ...]] = dict(getattr(model, "checkpoint_fused", {}))
        self.num_layers = max((layer.layer for layer in self.layers.values()), default=-1) + 1

    # -- what the registry and loaders read ------------------------------------------------

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {name: (m.in_features, m.out_features) for name, m in self.layers.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of every arena now (at most the budget)."""
        return sum(k.capacity * k.row_bytes for k in self.kinds.values())

    def describe(self) -> str:
        return (f"pool of {self.budget / 2**20:.1f} MiB ({self.used_bytes / 2**20:.1f} MiB placed), "
                f"ranks up to {self.max_rank}")

    def footprint(self, weights: LoraWeights) -> int:
        """Bytes `weights` take once placed: its rank rows in every layer of every kind it covers."""
        return weights.rank * sum(self.kinds[TARGETS.index(t)].row_bytes for t in weights.targets)

    def refusal(self, weights: LoraWeights) -> str | None:
        need = self.footprint(weights)
        if need > self.budget:
            return (f"the adapter needs {need / 2**20:.1f} MiB, more than the whole adapter pool "
                    f"({self.budget / 2**20:.1f} MiB, --lora-memory-gb)")
        return None

    def would_fit(self, weights: LoraWeights, freed: list[int]) -> bool:
        return self.used_bytes - sum(self.placed[h].nbytes for h in freed) + self.footprint(weights) <= self.budget

    def valid(self, handle: int) -> bool:
        return handle in self.placed

    # -- placing ----------------------------------------------------------------------------

    @torch.no_grad()
    def place(self, weights: LoraWeights) -> int | None:
        """Write `weights` (prepared for this pool) into every arena of its kinds; its handle, or None
        when the placed adapters leave too few bytes of the budget. Between forwards only."""
        if weights.rank > self.max_rank or set(weights.modules) - set(self.layers):
            raise ValueError("weights were not prepared for this pool")   # a caller bug, not user input
        need = self.footprint(weights)
        if self.used_bytes + need > self.budget:
            return None
        handle = next(h for h in itertools.count() if h not in self.placed)
        r = weights.rank
        kinds = tuple(TARGETS.index(t) for t in weights.targets)
        for kind in kinds:
            rows = self.kinds[kind]
            offset = rows.first_fit(r)
            if offset is None:
                self._make_room(rows, r)
                offset = rows.used
            rows.extents[handle] = (offset, r)
            for layer in rows.layers:
                pair = weights.modules.get(layer.name)
                if pair is None:
                    layer.A[offset:offset + r].zero_()
                    layer.Bt[offset:offset + r].zero_()
                else:
                    layer.A[offset:offset + r].copy_(pair[0])
                    layer.Bt[offset:offset + r].copy_(pair[1].t())
        self.placed[handle] = Placed(r, kinds, need)
        self.used_bytes += need
        return handle

    def _make_room(self, rows: KindRows, rank: int) -> None:
        """Leave `rank` free rows at rows.used: compact when the capacity has them, else grow
        (doubling, within what the budget leaves after the other kinds' arenas)."""
        self.version += 1
        need = rows.used + rank
        if rows.capacity >= need:
            rows.repack(rows.capacity)
            return
        row_bytes = rows.row_bytes
        others = [k for k in self.kinds.values() if k is not rows]
        if need * row_bytes + sum(k.capacity * k.row_bytes for k in others) > self.budget:
            for k in others:          # give back the spare rows of the other kinds first
                if k.capacity > k.used:
                    k.repack(k.used)
        affordable = (self.budget - sum(k.capacity * k.row_bytes for k in others)) // row_bytes
        # The placed bytes fit the budget, so the used rows of every kind do, and need <= affordable.
        rows.repack(max(need, min(2 * rows.capacity, affordable)))

    def free(self, handle: int) -> None:
        """Release a handle's rows (left as they are: no step row can point at them any more)."""
        placed = self.placed.pop(handle, None)
        if placed is None:
            raise ValueError(f"adapter handle {handle!r} is not placed")
        for kind in placed.kinds:
            del self.kinds[kind].extents[handle]
        self.used_bytes -= placed.nbytes

    def read(self, handle: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """What `handle` holds: module -> (A [r, in], B [out, r]) for every module of its kinds (copies)."""
        placed = self.placed[handle]
        out = {}
        for kind in placed.kinds:
            rows = self.kinds[kind]
            offset, r = rows.extents[handle]
            for layer in rows.layers:
                out[layer.name] = (layer.A[offset:offset + r].clone(), layer.Bt[offset:offset + r].t().clone())
        return out

    def choose_reading(self, record: ExecutionPlan) -> tuple[int, int]:
        """How the C++ operator reads a step's adapter rows: split over the threads by lora_cpu.GRAINS (the plan's
        lora_split), its blocks asking for their next rows paced, in bursts or not (lora_prefetch, a value of
        lora_cpu.PREFETCH). Each as pinned, else the fastest at this model's width and dtype (lora_cpu.time_reading,
        plan.pick): the grain first, then the prefetch at that grain, over as many bytes as twice the CPU's largest
        cache (so that the rows come from memory, as a step's do) or the pool's budget, whichever is less. Sets and
        returns (self.grain, self.prefetch), which the fused decode stack takes too."""
        if self.backend != "cpu":
            why = "adapter rows run in torch, on its threads"
            split, ahead = (record.record(path, PATHS[path][0], reason=why).chosen
                            for path in ("lora_split", "lora_prefetch"))
        else:
            width = Counter(layer.in_features for layer in self.layers.values()).most_common(1)[0][0]  # hidden
            split = self._choose(record, "lora_split", lora_cpu.TIMING_ROWS,
                                 lambda: lora_cpu.time_reading(width, self.dtype))
            arena = min(max(lora_cpu.TIMING_BYTES, 2 * lora_cpu.last_level_cache()), self.budget)
            ahead = self._choose(record, "lora_prefetch", lora_cpu.PREFETCH_ROWS,
                                 lambda: lora_cpu.time_reading(width, self.dtype, lora_cpu.GRAINS[split], arena))
        self.grain, self.prefetch = lora_cpu.GRAINS[split], lora_cpu.PREFETCH[ahead]
        if self.backend == "cpu":
            self.step.rows = functools.partial(lora_cpu.lora_rows, grain=self.grain, prefetch=self.prefetch)
        return self.grain, self.prefetch

    @staticmethod
    def _choose(record: ExecutionPlan, path: str, rows: int, timed) -> str:
        """`path` as pinned, else the faster of timed()'s candidates, timed at `rows` rows (plan.pick: the path's
        default, its first in PATHS, unless beaten)."""
        pin = record.pinned(path)
        if pin != AUTO:
            return record.record(path, pin).chosen
        seconds = timed()
        timings = [Timing(name, s, rows) for name, s in seconds.items()]
        return record.record(path, pick(seconds, PATHS[path][0]), timings).chosen

    # -- the fused decode stack ---------------------------------------------------------------

    def arenas(self) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """Per decoder layer: TARGETS index -> (A [P_t, K], Bt [P_t, N]) of that layer's projection.
        Read again whenever `version` changed (the tensors may have been replaced)."""
        out: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(self.num_layers)]
        for layer in self.layers.values():
            if layer.layer >= 0:
                out[layer.layer][layer.kind] = (layer.A, layer.Bt)
        return out

    # -- one forward ----------------------------------------------------------------------------

    @contextmanager
    def activate(self, spans: Sequence[RowSpan], num_rows: int) -> Iterator[PoolStep | None]:
        """Publish the step's offsets and ranks (see PoolStep) for one forward; with no spans nothing
        is built and every projection skips LoRA. spans: (first row, rows, handle)."""
        step = self.step
        if step.offsets is not None:
            raise RuntimeError("adapter pool activated twice (nested forwards)")
        if not spans:
            yield None
            return
        offsets, ranks = step_rows(spans, num_rows, self._rows_of)
        step.offsets, step.ranks = offsets, ranks
        step.active = tuple(bool(v) for v in ranks.any(dim=1).tolist())
        try:
            yield step
        finally:
            step.offsets = step.ranks = None
            step.active = PoolStep.active

    def _rows_of(self, handle: int) -> Mapping[int, tuple[int, int]]:
        placed = self.placed.get(handle)
        if placed is None:
            raise ValueError(f"adapter handle {handle!r} is not placed")
        return {kind: self.kinds[kind].extents[handle] for kind in placed.kinds}


def step_rows(spans: Sequence[RowSpan], num_rows: int, rows_of) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets, ranks) [len(TARGETS), num_rows] int32 for spans (first row, rows, handle);
    rows_of(handle) -> {kind: (offset, rank)}. Filled as lists: one tensor build per step."""
    offsets = [[0] * num_rows for _ in TARGETS]
    ranks = [[0] * num_rows for _ in TARGETS]
    for start, n, handle in spans:
        for kind, (offset, r) in rows_of(handle).items():
            offsets[kind][start:start + n] = [offset] * n
            ranks[kind][start:start + n] = [r] * n
    return torch.tensor(offsets, dtype=torch.int32), torch.tensor(ranks, dtype=torch.int32)
