"""Image placeholders -> physical prompt ids, M-RoPE positions [3, T], the decode delta and image rows.

The chat template writes one image_token_id per image (Qwen2-VL: <|vision_start|><|image_pad|>
<|vision_end|>). Each becomes t*h*w copies (the post-merge grid: one KV position per projected row),
before the caller checks the context length or the engine reserves KV.

Rotary positions mirror transformers' Qwen2VLModel.get_rope_index (5.24):
- a text token (vision_start/vision_end included) takes the cursor on all three axes, cursor += 1;
- image row (tt, hh, ww) takes (cursor + tt, cursor + hh, cursor + ww), then cursor += max(h, w),
  which is max(image coords) + 1 because t == 1 for images (see images.py);
- delta = max(all positions) + 1 - T, so decode continues at physical + delta on every axis.
A prompt without images gets arange(T) on all three axes, i.e. plain RoPE, and delta 0.

Each placeholder is expanded on its own. transformers groups *adjacent* image tokens into one image;
templates always frame images with vision_start/vision_end, so the two never disagree in practice.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.engine.request import SpanKey
from services.decoder.engine.step import PlacedImages
from services.decoder.model.config import VisionTokens
from services.decoder.multimodal.images import PARAM, ImageInput
from services.decoder.multimodal.keys import image_span_keys


@dataclass(frozen=True)
class VisionPrompt:
    """A prompt with its images placed.

    token_ids [T]: physical ids, image i occupying spans[i] = [start, end) with end - start = t*h*w.
    positions [3, T] long: rotary (time, height, width) coordinates. delta: decode rotary position
    minus physical position. image_rows: absolute position -> row [hidden] (views of the images' rows).
    """

    token_ids: list[int]
    positions: torch.Tensor
    delta: int
    sections: tuple[int, int, int]
    images: tuple[ImageInput, ...]
    spans: tuple[tuple[int, int], ...]
    image_rows: dict[int, torch.Tensor]

    def placed(self) -> PlacedImages:
        """What the runner consumes per chunk (runner/batch.py): M-RoPE and rows by absolute position."""
        return PlacedImages(self.positions, self.delta, self.sections, self.image_rows)

    def span_keys(self) -> tuple[SpanKey, ...]:
        """Prefix-cache salts for the engine (see keys.py)."""
        return image_span_keys(self.images, self.spans, self.sections, self.delta, len(self.token_ids))


def rope_index(token_ids: Sequence[int], image_token_id: int,
               grids: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    """Physical ids [T] (images already expanded, grids in order) -> (positions [3, T] long, delta).

    Runs of image_token_id are matched to grids in order; each run must hold exactly t*h*w ids.
    """
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    n = ids.numel()
    positions = torch.empty(3, n, dtype=torch.long)
    is_image = (ids == image_token_id).tolist()
    cursor, pos, index = 0, 0, 0
    while pos < n:
        if not is_image[pos]:
            end = pos
            while end < n and not is_image[end]:
                end += 1
            positions[:, pos:end] = torch.arange(cursor, cursor + end - pos)
            cursor += end - pos
            pos = end
            continue
        if index >= len(grids):
            raise InvalidArgument("more image placeholders than images", param=PARAM)
        t, h, w = grids[index]
        size = t * h * w
        if pos + size > n or not all(is_image[pos:pos + size]):
            raise InvalidArgument(f"image {index} needs {size} consecutive placeholder ids", param=PARAM)
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        positions[:, pos:pos + size] = torch.stack([tt, hh, ww]).reshape(3, -1) + cursor
        cursor += max(h, w)
        pos += size
        index += 1
    if index != len(grids):
        raise InvalidArgument(f"{len(grids)} images but {index} placeholder runs", param=PARAM)
    delta = (int(positions.max()) + 1 - n) if n else 0
    return positions, delta


def expand_images(token_ids: Sequence[int], images: Sequence[ImageInput], tokens: VisionTokens,
                  sections: tuple[int, int, int]) -> VisionPrompt:
    """Template-rendered ids [T0] with one image_token_id per image -> VisionPrompt with T = T0 - k + sum(t*h*w).

    Raises InvalidArgument when the placeholder count differs from the number of images (which is also
    what a chat template that cannot place images produces: zero placeholders), Unsupported for video.
    """
    ids = list(token_ids)
    if tokens.video_token_id is not None and tokens.video_token_id in ids:
        raise Unsupported("video inputs are not supported", param="messages")
    count = ids.count(tokens.image_token_id)
    if count != len(images):
        raise InvalidArgument(f"the prompt has {count} image placeholder(s) for {len(images)} image(s); the chat "
                              f"template must place each image exactly once", param=PARAM)
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    rows: dict[int, torch.Tensor] = {}
    index = 0
    for tid in ids:
        if tid != tokens.image_token_id:
            out.append(tid)
            continue
        image = images[index]
        start = len(out)
        out.extend([tid] * image.num_rows)
        spans.append((start, len(out)))
        rows.update(zip(range(start, len(out)), image.rows.unbind(0), strict=True))
        index += 1
    positions, delta = rope_index(out, tokens.image_token_id, [im.grid for im in images])
    return VisionPrompt(out, positions, delta, tuple(sections), tuple(images), tuple(spans), rows)
