"""Untrusted image bytes -> an RGB uint8 array, with every limit checked before pixels are decoded.

Only PNG, JPEG, WebP and GIF are opened: PIL's other plugins (EPS runs
Ghostscript, TIFF/PSD have large attack surfaces) are never consulted. Animated
GIF/WebP give their first frame. Data URIs and mime types are services/common/data_uri.py's.
"""
from __future__ import annotations

import io
import re
import struct
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from services.common.data_uri import FORMATS, check_mime
from services.common.errors import InvalidArgument, TooLarge, Unsupported


@dataclass(frozen=True)
class Limits:
    """Per-image input limits."""

    max_bytes: int
    max_pixels: int




# A Python object's repr inside a library's message ("cannot identify image file <_io.BytesIO object at 0x7f..>"):
# it tells the caller nothing and the process's addresses are not theirs to see.
_REPR = re.compile(r"\s*<[^<>]*\bat 0x[0-9a-fA-F]+>")


def _plain(exc: BaseException) -> str:
    """exc's message without object reprs, on one line."""
    return " ".join(_REPR.sub("", str(exc)).split()) or type(exc).__name__


def _open(data: bytes, param: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Our own pixel check below is the limit; PIL's bomb warning would only duplicate it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError as exc:
        raise TooLarge(f"image has too many pixels ({_plain(exc)})", param=param) from None
    except (OSError, SyntaxError, ValueError, struct.error, EOFError) as exc:
        raise InvalidArgument(f"not a decodable PNG, JPEG, WebP or GIF image ({_plain(exc)})",
                              param=param) from None


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
        raise InvalidArgument(f"image could not be decoded ({_plain(exc)})", param=param) from None
