"""A StepInput flattened into the tensors one forward pass needs.

Tokens of all chunks are concatenated in step order (no padding). Physical positions
drive KV slots and causal masks; rotary positions are the physical ones, or, for a
request that carries placed images (ScheduledChunk.images), its prompt coordinates and then
physical + delta.
Image rows are looked up by absolute position, so a chunk replaces only the rows inside
its own interval [start, start + len), whether it is a first prefill, the rest after a
prefix hit, or a recompute after preemption.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.engine.step import ScheduledChunk, StepInput
from services.decoder.runner.attention import AttentionPlan
from services.decoder.runner.windows import Windows


@dataclass
class StepBatch:
    input_ids: torch.Tensor                       # [N] long
    positions: torch.Tensor                       # [N] or [3, N] long: rotary positions
    plan: AttentionPlan
    sample_rows: torch.Tensor                     # [R] rows whose logits are sampled: 1 + drafts per chunk
    sampled: list[ScheduledChunk]                 # the chunks that own them, in the same order
    image_rows: list[tuple[int, torch.Tensor]]    # (row in the step, embedding [hidden])
    # (first row, rows, slot) per chunk whose request leased an adapter slot; empty
    # for a base-only step, which then does no LoRA work at all.
    lora_spans: list[tuple[int, int, int]] = field(default_factory=list)

    @staticmethod
    def build(step: StepInput, block_size: int, device: torch.device,
              mrope_sections: tuple[int, int, int] | None, attention_backend: str,
              windows: Windows = Windows()) -> StepBatch:
        """attention_backend: the runner's decode attention (runner/attention.py's CPP or TORCH); windows: the
        model's sliding windows and soft-cap (runner/windows.py)."""
        chunks = step.chunks
        if not chunks or any(not c.token_ids for c in chunks):
            raise InvalidArgument("a step needs at least one chunk and every chunk at least one token")
        ids, physical, sample_rows, sampled, images, lora = [], [], [], [], [], []
        offset = 0
        for c in chunks:
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            physical.append(torch.arange(c.start, c.start + n, device=device))
            if c.sample:
                # The last known token's row, then one row per draft (each verifies the next).
                sample_rows.extend(range(offset + n - 1 - len(c.draft_token_ids), offset + n))
                sampled.append(c)
            if c.lora_slot is not None:
                lora.append((offset, n, c.lora_slot))   # every row of the chunk uses its request's slot
            rows = c.images.rows if c.images is not None else None
            if rows:
                # Look up the chunk's own positions, not every saved row: a decode step of a request
                # with a large image then costs O(1) here instead of O(rows).
                for pos in range(c.start, c.start + n):
                    row = rows.get(pos)
                    if row is not None:
                        images.append((offset + pos - c.start, row))
            offset += n
        positions = torch.cat(physical)
        if any(c.images is not None for c in chunks):
            positions = _mrope_positions(chunks, positions, mrope_sections)
        plan = AttentionPlan.build([(c.start, len(c.token_ids), c.block_table) for c in chunks],
                                   block_size, device, attention_backend, windows)
        return StepBatch(torch.tensor(ids, dtype=torch.long, device=device), positions, plan,
                         torch.tensor(sample_rows, dtype=torch.long, device=device), sampled, images,
                         lora_spans=lora)


def _mrope_positions(chunks: list[ScheduledChunk], physical: torch.Tensor,
                     sections: tuple[int, int, int] | None) -> torch.Tensor:
    """[3, N]: text-only requests repeat their physical position on all three axes."""
    if sections is None:
        raise Unsupported("this model has no M-RoPE sections; it cannot take image positions")
    axes = physical[None].expand(3, -1).clone()
    offset = 0
    for c in chunks:
        n = len(c.token_ids)
        images = c.images
        if images is not None:
            if images.sections is not None and tuple(images.sections) != tuple(sections):
                raise InvalidArgument(f"M-RoPE sections {tuple(images.sections)} differ from the model's {sections}")
            prompt = images.positions.to(axes.device)                          # [3, T_prompt]
            pos = physical[offset:offset + n]
            in_prompt = pos < prompt.shape[1]
            # Decode (and any text past the prompt) continues at physical + delta on every axis.
            rows = torch.where(in_prompt[None], prompt[:, pos.clamp(max=prompt.shape[1] - 1)],
                               (pos + int(images.delta))[None])
            axes[:, offset:offset + n] = rows
        offset += n
    return axes
