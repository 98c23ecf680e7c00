"""Per-step grouping metadata for multi-LoRA batches, built once and reused by every layer.

A step's rows each select an adapter slot (``-1`` = base only). Every LoRA
projection in every layer needs the same grouping: which rows belong to which
slot, in what order, and how the SGMV grid tiles them. Sorting per projection
would repeat an argsort and a device->host sync ~7 x num_layers times per step,
so the runner calls :func:`build_lora_meta` once per step and hands the result to
every :func:`services.decoder.kernels.lora.lora_apply` call.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# tl.dot needs every block dimension >= 16 on NVIDIA GPUs, so this is the
# smallest row tile SGMV can use.
MIN_BLOCK_M = 16
# Below this many rows per segment a tl.dot row tile is mostly padding, and
# the per-row BGMV kernels do less wasted work.
BGMV_MAX_SEGMENT = 8


@dataclass(frozen=True)
class LoraBatchMeta:
    """Grouping of a step's rows by adapter slot. All tensors are int32 on ``device``.

    Shapes (N rows in the step, M = rows with slot >= 0, G segments, T tiles):
      slots        [N]    per-row slot, -1 = base only (used by BGMV)
      sorted_rows  [M]    original row index of each adapter row, grouped by slot
                          (stable: rows keep their order inside a segment)
      seg_starts   [G+1]  segment g is sorted_rows[seg_starts[g]:seg_starts[g+1]]
      seg_slots    [G]    slot of segment g
      tile_start   [T]    first sorted position of tile t
      tile_end     [T]    end (exclusive) of tile t's segment; rows >= it are masked
      tile_slot    [T]    slot of tile t
    Host copies (python ints, so launchers never sync with the device):
      segments     ((slot, start, end), ...) one per segment, empty ones included
      num_rows N, num_adapter_rows M, num_tiles T, block_m (rows per SGMV tile)
      decode_only  True: the dispatch uses BGMV (one gathered GEMV per row)
    """

    slots: torch.Tensor
    sorted_rows: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    tile_slot: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    num_rows: int
    num_adapter_rows: int
    num_tiles: int
    block_m: int
    decode_only: bool

    @property
    def has_adapters(self) -> bool:
        """False when every row is base only: lora_apply then launches nothing."""
        return self.num_adapter_rows > 0


def build_lora_meta(slots: torch.Tensor | Sequence[int], *, device: torch.device | str | None = None,
                    num_slots: int | None = None, block_m: int = 32,
                    decode_only: bool | None = None) -> LoraBatchMeta:
    """Group rows by slot once per step.

    slots: [N] ints, -1 = base only. num_slots: when given, a segment is emitted for
    every slot 0..num_slots-1 (empty ones have start == end and get no tiles);
    otherwise only slots present in the batch get segments. block_m: rows per SGMV
    tile (power of two >= 16). decode_only: force the BGMV (True) or SGMV (False)
    kernels; None picks BGMV when no segment is longer than BGMV_MAX_SEGMENT.

    Equivalent torch pseudocode:
        sorted_rows = argsort(slots, stable=True)[slots_sorted >= 0]
        seg_starts  = cumsum([0] + counts per slot)
        tiles       = [(start + i*block_m, end, slot) for each segment for i in range(ceil(len/block_m))]
    """
    if block_m < MIN_BLOCK_M or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {MIN_BLOCK_M}, got {block_m}")
    # The grouping is computed on the host: slots come from the scheduler as
    # host data, and the launch grid size must be a python int anyway.
    host = torch.as_tensor(slots, dtype=torch.int64).detach().to("cpu").reshape(-1)
    if device is None:
        device = slots.device if isinstance(slots, torch.Tensor) else torch.device("cpu")
    if host.numel() and int(host.min()) < -1:
        raise ValueError("slots must be >= -1 (-1 = base only)")
    if num_slots is not None and host.numel() and int(host.max()) >= num_slots:
        raise ValueError(f"slot {int(host.max())} out of range for {num_slots} slots")

    order = torch.argsort(host, stable=True)
    sorted_slots = host[order]
    first = int(torch.searchsorted(sorted_slots, torch.tensor(0)))  # skip the -1 rows
    sorted_rows = order[first:]
    present = sorted_slots[first:]
    if num_slots is None:
        seg_slot_ids, counts = torch.unique_consecutive(present, return_counts=True)
    else:
        seg_slot_ids = torch.arange(num_slots)
        counts = torch.bincount(present, minlength=num_slots)
    seg_starts = torch.zeros(len(seg_slot_ids) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=seg_starts[1:])

    segments, tiles = [], []
    for slot, start, end in zip(seg_slot_ids.tolist(), seg_starts[:-1].tolist(), seg_starts[1:].tolist(),
                                strict=True):
        segments.append((slot, start, end))
        tiles.extend((t, end, slot) for t in range(start, end, block_m))
    tile_tab = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3)
    longest = int(counts.max()) if counts.numel() else 0
    if decode_only is None:
        decode_only = longest <= BGMV_MAX_SEGMENT

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype=torch.int32).contiguous().to(device)

    return LoraBatchMeta(
        slots=dev(host), sorted_rows=dev(sorted_rows), seg_starts=dev(seg_starts), seg_slots=dev(seg_slot_ids),
        tile_start=dev(tile_tab[:, 0]), tile_end=dev(tile_tab[:, 1]), tile_slot=dev(tile_tab[:, 2]),
        segments=tuple(segments), num_rows=host.numel(), num_adapter_rows=sorted_rows.numel(),
        num_tiles=len(tiles), block_m=block_m, decode_only=bool(decode_only),
    )
