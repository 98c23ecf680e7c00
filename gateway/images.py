"""Image parts of a chat -> the decoder's ImageInputs, through one vision Encode call per request.

Order of the checks, cheapest and most certain first, so a refused request costs no vision work:
every URL must be an inline data: URI (http(s) is refused: nothing is ever fetched), the count must be
within the model's limits.max_images (413 past it), the model must take images (its decoder's
GetModelInfo said supports_images), a vision service must be configured, and each URI must parse within
limits.max_image_bytes (413 past it). The limits are the decoder's, read from its GetModelInfo
(RequestLimits): the gateway keeps no numbers of its own for a rule the decoder owns. Only then do the
bytes go to the vision service, which decodes them (a truncated PNG, SVG, a 20000x20000 header are its
refusals, mapped through the one error table).
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from prometheus_client import Counter

from services.common.data_uri import parse_data_uri
from services.common.errors import (
    PARAM_KEY,
    Internal,
    InvalidArgument,
    TesseraError,
    TooLarge,
    Unavailable,
    Unsupported,
    error_for,
)
from services.common.pb import decoder_pb2, vision_pb2

from .backends import Backend, Model

# What the vision service answered from, per image: "cache" (Redis hit) or "encoder" (computed).
IMAGES = Counter("tessera_gateway_images_total", "images sent to the vision service, by where the rows came from",
                 ["source"])


@dataclass(frozen=True)
class ImageRef:
    """One image_url part: where it sits (for messages) and its URL."""

    where: str  # "messages[i].content[j]"
    url: str


def check_urls(refs: list[ImageRef], model: Model, vision: Backend | None) -> None:
    """Everything decidable without reading an image: remote URLs, count (model.limits), model, vision
    configured."""
    for ref in refs:
        scheme = ref.url[:16].partition(":")[0].strip().lower()
        if scheme in ("http", "https"):
            raise InvalidArgument(f"{ref.where}: remote image URLs are refused (nothing is fetched); send the"
                                  " image inline as a data:image/...;base64 URI", param="messages")
        if scheme != "data":
            raise InvalidArgument(f"{ref.where}: image_url.url must be a data: URI"
                                  " (data:image/png;base64,...)", param="messages")
    max_images = model.limits.max_images
    if len(refs) > max_images:
        # The decoder's rule and wording (services/decoder/server/validation.py), checked here before any
        # vision work is spent.
        raise TooLarge(f"{len(refs)} images in one request; at most {max_images} per request", param="messages")
    if not model.extra.get("supports_images"):
        raise Unsupported(f"{refs[0].where}: model {model.name!r} is text-only and refuses image inputs",
                          param="messages")
    if vision is None:
        raise Unsupported("this gateway has no vision service, so it cannot take images: start it with"
                          " --vision HOST:PORT", param="messages")


def decode_uris(refs: list[ImageRef], max_bytes: int) -> list[vision_pb2.ImageData]:
    """Each data URI -> the bytes and declared mime type (parse_data_uri refuses bad URIs, 413 past max_bytes)."""
    out = []
    for ref in refs:
        try:
            data, mime = parse_data_uri(ref.url, max_bytes, param="messages")
        except TesseraError as err:
            raise error_for(err.reason, f"{ref.where}: {err.message}", "messages") from None
        out.append(vision_pb2.ImageData(data=data, mime_type=mime))
    return out


async def encode(vision: Backend, refs: list[ImageRef], images: list[vision_pb2.ImageData],
                 request_id: str, salt: str = "") -> tuple[list[decoder_pb2.ImageInput], int]:
    """One Encode call for all of the request's images -> (ImageInputs in the same order, how many of them
    the vision service answered from its feature cache). salt: the tenant's cache salt (gateway/tenants.py), so
    those hits are only ever the tenant's own images.

    The call is made here rather than through Backend.call because the vision service names the failing
    image as param images[k]; that index is turned back into the part's place in the messages.
    """
    try:
        reply = await vision.vision.Encode(vision_pb2.EncodeRequest(images=images, request_id=request_id,
                                                                    cache_salt=salt),
                                           timeout=vision.cfg.grpc_timeout_s,
                                           metadata=vision.metadata(request_id))
    except grpc.aio.AioRpcError as exc:
        err = vision.public_error(exc, request_id)
        if err.reason == "UNAVAILABLE":
            raise Unavailable(err.message, param="messages") from None
        where = _part_named(dict(exc.trailing_metadata() or ()).get(PARAM_KEY, ""), refs)
        raise error_for(err.reason, f"{where}: {err.message}" if where else err.message, "messages") from None
    if len(reply.images) != len(refs):
        raise Internal(f"the vision service answered {len(reply.images)} images for {len(refs)}")
    for image in reply.images:
        IMAGES.labels("cache" if image.cached else "encoder").inc()
    return [decoder_pb2.ImageInput(rows=image.rows, grid=image.grid, content_hash=image.content_hash)
            for image in reply.images], sum(image.cached for image in reply.images)


def _part_named(param: str, refs: list[ImageRef]) -> str | None:
    """'images[2]' (the vision service's param) -> the third image part's place in the messages."""
    head, _, rest = param.partition("[")
    index = rest.rstrip("]")
    if head == "images" and index.isdigit() and int(index) < len(refs):
        return refs[int(index)].where
    return None
