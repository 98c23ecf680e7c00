"""Prefix-cache salts for image prompts: which inputs besides token ids a KV block consumed.

Selective, not the spec's conservative salt-every-block: image i salts only the blocks overlapping its
own placeholder span [start, end), with (digest of its rows, grid, start, M-RoPE sections). Every later
block is covered through the hash chain (a block hash includes its parent's), and text blocks before the
first image stay shareable with text-only prompts that have the same prefix, which computed the same KV
(same ids, plain positions there). So two requests with the same placeholders and different images
share no block from the first block that holds an image row onward.

The continuation delta is a function of the grids and positions already chained, but decode is where it
is consumed, so it also salts every block from the first position after the prompt.
"""
from __future__ import annotations

from collections.abc import Sequence

from services.decoder.engine.request import SpanKey
from services.decoder.multimodal.images import ImageInput

# Span end for "to the end of the sequence": larger than any position a request can reach.
UNBOUNDED = 1 << 62


def image_span_keys(images: Sequence[ImageInput], spans: Sequence[tuple[int, int]],
                    sections: tuple[int, int, int], delta: int, prompt_len: int) -> tuple[SpanKey, ...]:
    """(start, end, key) per image, plus (prompt_len, UNBOUNDED, delta key); none for a text-only prompt."""
    if not images:
        return ()
    keys: list[SpanKey] = [
        (start, end, ("image", image.digest, tuple(image.grid), start, tuple(sections)))
        for image, (start, end) in zip(images, spans, strict=True)]
    keys.append((prompt_len, UNBOUNDED, ("mrope_delta", delta, tuple(sections))))
    return tuple(keys)
