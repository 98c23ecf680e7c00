"""Untrusted image bytes -> an RGB uint8 array, with every limit checked before pixels are decoded.

Only PNG, JPEG, WebP and GIF are opened: PIL's other plugins (EPS runs
Ghostscript, TIFF/PSD have large attack surfaces) are never consulted. Animated
GIF/WebP give their first frame. Nothing is fetched: `parse_data_uri` refuses
http(s) URLs; the gateway reuses it for OpenAI `image_url` parts.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import struct
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from services.common.errors import InvalidArgument, TooLarge, Unsupported

# PIL format name -> the mime types a client may declare for it.
FORMATS = {"PNG": ("image/png",), "JPEG": ("image/jpeg", "image/jpg"), "WEBP": ("image/webp",),
           "GIF": ("image/gif",)}
MIME_TYPES = frozenset(m for mimes in FORMATS.values() for m in mimes)

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)"
                       r"(?P<b64>;base64)?,(?P<data>.*)$", re.DOTALL)


@dataclass(frozen=True)
class Limits:
    """Per-image input limits."""

    max_bytes: int
    max_pixels: int


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


def _open(data: bytes, param: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Our own pixel check below is the limit; PIL's bomb warning would only duplicate it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError as exc:
        raise TooLarge(f"image has too many pixels ({exc})", param=param) from None
    except (OSError, SyntaxError, ValueError, struct.error, EOFError) as exc:
        raise InvalidArgument(f"not a decodable PNG, JPEG, WebP or GIF image ({exc})", param=param) from None


def to_rgb(im: Image.Image) -> np.ndarray:
    """A loaded PIL image -> [H, W, 3] uint8.

    Transparency is composited onto white (as transformers' convert_to_rgb
    does); 16/32-bit grey is scaled to 8 bits rather than clipped, which is
    what PIL's own convert("RGB") would do.
    """
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        grey = np.asarray(im).astype(np.float64)
        # "I" from a 16-bit file still holds 0..65535; an 8-bit range passes unchanged.
        scale = 257.0 if im.mode != "I" or grey.max(initial=0) > 255 else 1.0
        grey = np.clip(np.rint(grey / scale), 0, 255).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.array(im.convert("RGB"))


def decode(data: bytes, limits: Limits, mime: str = "", param: str = "images") -> np.ndarray:
    """Compressed image bytes -> [H, W, 3] uint8 RGB (first frame, EXIF orientation applied).

    Order matters: byte size, then the header's dimensions, and only then the
    pixels, so neither a huge upload nor a decompression bomb is ever decoded.
    """
    if not data:
        raise InvalidArgument("image data is empty", param=param)
    if len(data) > limits.max_bytes:
        raise TooLarge(f"image is {len(data)} bytes; the limit is {limits.max_bytes}", param=param)
    if data.lstrip()[:5].lower() in (b"<?xml", b"<svg ", b"<svg>"):
        raise Unsupported("SVG images are not supported; send PNG, JPEG, WebP or GIF", param=param)
    declared = check_mime(mime, param) if mime else ""
    im = _open(data, param)
    width, height = im.size
    if width < 1 or height < 1:
        raise InvalidArgument(f"image has no pixels ({width}x{height})", param=param)
    if width * height > limits.max_pixels:
        raise TooLarge(f"image is {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels}",
                       param=param)
    if declared and declared not in FORMATS[im.format]:
        raise InvalidArgument(f"declared {declared!r} but the bytes are {im.format}", param=param)
    try:
        im.seek(0)
        im.load()
        im = ImageOps.exif_transpose(im)
        return to_rgb(im)
    except Image.DecompressionBombError:
        raise TooLarge("image has too many pixels", param=param) from None
    except (OSError, SyntaxError, ValueError, struct.error, EOFError) as exc:
        raise InvalidArgument(f"image could not be decoded ({exc})", param=param) from None
