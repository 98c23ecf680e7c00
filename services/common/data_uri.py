"""Image data URIs and the image mime types the fleet accepts.

Shared by the gateway (OpenAI `image_url` parts) and the vision service (the declared
mime type of raw bytes). Nothing is fetched: `parse_data_uri` refuses http(s) URLs.
"""
from __future__ import annotations

import base64
import binascii
import re

from services.common.errors import InvalidArgument, TooLarge, Unsupported

# PIL format name -> the mime types a client may declare for it.
FORMATS = {"PNG": ("image/png",), "JPEG": ("image/jpeg", "image/jpg"), "WEBP": ("image/webp",),
           "GIF": ("image/gif",)}
MIME_TYPES = frozenset(m for mimes in FORMATS.values() for m in mimes)

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)"
                       r"(?P<b64>;base64)?,(?P<data>.*)$", re.DOTALL)


def check_mime(mime: str, param: str = "mime_type") -> str:
    """Lower-cased mime if it names a supported format; Unsupported otherwise (SVG included)."""
    mime = mime.strip().lower()
    if mime not in MIME_TYPES:
        raise Unsupported(f"unsupported image type {mime!r}; supported: {', '.join(sorted(MIME_TYPES))}",
                          param=param)
    return mime


def parse_data_uri(uri: str, max_bytes: int, param: str = "image_url") -> tuple[bytes, str]:
    """`data:image/png;base64,...` -> (bytes, mime).

    Refuses remote URLs (nothing is fetched), malformed URIs, non-base64
    payloads, non-image or unsupported mime types, and payloads over max_bytes
    (checked on the encoded length first, so a huge string is never decoded).
    """
    head = uri[:16].lower()
    if head.startswith(("http://", "https://")):
        raise InvalidArgument("remote image URLs are not fetched; send the image as a base64 data URI",
                              param=param)
    m = _DATA_URI.match(uri)
    if m is None:
        raise InvalidArgument("malformed image URL: expected data:<mime>;base64,<data>", param=param)
    if not m["b64"]:
        raise InvalidArgument("image data URIs must be base64-encoded", param=param)
    mime = check_mime(m["mime"], param)
    payload = m["data"]
    # base64 is 4 chars per 3 bytes: refuse before decoding anything big.
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise TooLarge(f"image is larger than {max_bytes} bytes", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument("image data URI is not valid base64", param=param) from None
    if len(data) > max_bytes:
        raise TooLarge(f"image is {len(data)} bytes; the limit is {max_bytes}", param=param)
    if not data:
        raise InvalidArgument("image data is empty", param=param)
    return data, mime
