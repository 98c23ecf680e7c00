"""A GenerateRequest's images, checked against its chat parts, and placed into its prompt ids.

    images = request_images(request, model_config, model="name")                 # before rendering
    placed = place_images(prompt_ids, images, model_config)                        # after rendering
    engine.generate(rid, placed.token_ids, params, images=placed.images, span_keys=placed.span_keys)

Contract (decoder.proto): GenerateRequest.images[i] is ImageInput{rows, grid, content_hash}; a chat
ContentPart with image_index = i places image i there. Every image is referenced exactly once; the n-th
image part in message order is the n-th image the template places. Nothing is dropped: image parts or
images for a text-only model, images without a chat prompt, and a template that does not place them are
all refused with a typed error.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.engine.request import SpanKey
from services.decoder.engine.step import PlacedImages
from services.decoder.model.config import ModelConfig
from services.decoder.multimodal.images import PARAM, ImageInput, image_from_proto
from services.decoder.multimodal.prompt import expand_images


@dataclass(frozen=True)
class PlacedPrompt:
    """Physical prompt ids [T] and what the engine needs besides them (None/() for a text-only prompt)."""

    token_ids: list[int]
    images: PlacedImages | None = None
    span_keys: tuple[SpanKey, ...] = field(default_factory=tuple)


def image_part_order(request) -> list[int]:
    """image_index of every image part of request.chat, in message order ([] for other prompt kinds)."""
    if request.WhichOneof("prompt") != "chat":
        return []
    return [p.image_index for m in request.chat.messages for p in m.content if p.WhichOneof("kind") == "image_index"]


def request_images(request, config: ModelConfig, *, model: str) -> list[ImageInput]:
    """The request's images in placement order, validated (rows decoded with shape checks).

    How many images a request may carry is the rulebook's (services/decoder/server/validation.py, checked
    first). Raises Unsupported (a text-only model; video), InvalidArgument
    (images without a chat prompt, an image_index out of range or used twice, an unreferenced image,
    bad rows/grid/hash).
    """
    order = image_part_order(request)
    given = len(request.images)
    if not order and not given:
        return []
    if config.vision is None:
        raise Unsupported(f"model {model!r} is text-only and refuses image inputs", param="messages")
    if request.WhichOneof("prompt") != "chat":
        raise InvalidArgument("images need a chat prompt whose content parts place them (image_index)", param=PARAM)
    for index in order:
        if not 0 <= index < given:
            raise InvalidArgument(f"image_index {index} is out of range: {given} image(s) given", param="messages")
    if sorted(order) != list(range(given)):
        raise InvalidArgument(f"each image must be placed exactly once; content parts place {order} of {given} "
                              f"image(s)", param="messages")
    return [image_from_proto(request.images[i], config.hidden_size, i) for i in order]


def place_images(token_ids: Sequence[int], images: Sequence[ImageInput], config: ModelConfig) -> PlacedPrompt:
    """Rendered ids -> PlacedPrompt. A vision model checks placeholders even without images (a prompt
    holding image ids but no image is refused); a prompt without images keeps plain positions."""
    if config.vision is None:
        return PlacedPrompt(list(token_ids))
    vision = expand_images(token_ids, images, config.vision, config.mrope_sections)
    if not images:
        return PlacedPrompt(vision.token_ids)
    return PlacedPrompt(vision.token_ids, vision.placed(), vision.span_keys())
