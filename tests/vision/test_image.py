"""Untrusted bytes: formats, colour modes, limits before decoding, data URIs."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from services.common.data_uri import parse_data_uri
from services.common.errors import InvalidArgument, TooLarge, Unsupported
from services.vision.image import Limits, decode

LIMITS = Limits(1 << 20, 1 << 22)


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def rgb_image(w=24, h=16, seed=0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                      ("GIF", "image/gif")])
def test_formats_decode_to_rgb(fmt, mime):
    im = rgb_image()
    out = decode(encode(im, fmt), LIMITS, mime)
    assert out.shape == (16, 24, 3) and out.dtype == np.uint8
    if fmt == "PNG":
        assert (out == np.asarray(im)).all()


def test_gif_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(data)).n_frames == 2
    out = decode(data, LIMITS)
    assert tuple(out[0, 0]) == (255, 0, 0)


def test_alpha_composites_on_white_and_palette():
    rgba = np.zeros((4, 4, 4), np.uint8)  # fully transparent black
    assert (decode(encode(Image.fromarray(rgba, "RGBA"), "PNG"), LIMITS) == 255).all()
    la = Image.fromarray(np.stack([np.full((4, 4), 10, np.uint8), np.full((4, 4), 255, np.uint8)], -1), "LA")
    assert (decode(encode(la, "PNG"), LIMITS) == 10).all()
    pal = Image.new("P", (4, 4), 0)
    pal.putpalette([0, 128, 0] * 256)
    assert tuple(decode(encode(pal, "PNG"), LIMITS)[0, 0]) == (0, 128, 0)


def test_sixteen_bit_grey_is_scaled_not_clipped():
    grey = (np.arange(16, dtype=np.uint16) * 4369).reshape(4, 4)  # 0 .. 65535
    out = decode(encode(Image.fromarray(grey), "PNG"), LIMITS)
    assert out[..., 0].ravel().tolist() == [round(v / 257) for v in grey.ravel()]


def test_cmyk_jpeg():
    data = encode(Image.new("CMYK", (8, 8), (0, 0, 0, 0)), "JPEG")
    assert (decode(data, LIMITS) > 250).all()  # no ink is white


def test_bad_bytes_are_invalid_argument():
    good = encode(rgb_image(), "PNG")
    with pytest.raises(InvalidArgument, match="empty"):
        decode(b"", LIMITS)
    with pytest.raises(InvalidArgument):
        decode(good[: len(good) // 2], LIMITS)  # truncated
    with pytest.raises(InvalidArgument):
        decode(b"hello, this is not an image at all", LIMITS)
    with pytest.raises(Unsupported):
        decode(b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', LIMITS)
    with pytest.raises(InvalidArgument):  # a format PIL knows but we never open
        decode(encode(rgb_image(), "BMP"), LIMITS)
    with pytest.raises(Unsupported):
        decode(good, LIMITS, "image/svg+xml")
    with pytest.raises(InvalidArgument, match="declared"):
        decode(good, LIMITS, "image/jpeg")


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height, with a tiny body: decoding it would need the pixels."""
    raw = encode(Image.new("L", (1, 1)), "PNG")
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return raw[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + raw[33:]


def test_pixel_limit_checked_from_the_header():
    with pytest.raises(TooLarge, match="too many pixels|20000x20000"):
        decode(bomb_png(20000, 20000), Limits(1 << 20, 40_000_000))
    with pytest.raises(TooLarge, match="6000x6000"):  # under PIL's own bomb guard: ours refuses it
        decode(bomb_png(6000, 6000), Limits(1 << 20, 1_000_000))
    with pytest.raises(TooLarge):
        decode(encode(rgb_image(), "PNG"), Limits(1 << 20, 100))
    with pytest.raises(TooLarge):
        decode(encode(rgb_image(), "PNG"), Limits(10, 1 << 20))


def test_data_uri():
    png = encode(rgb_image(), "PNG")
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    assert parse_data_uri(uri, 1 << 20) == (png, "image/png")
    for bad, err in [("https://example.com/cat.png", InvalidArgument), ("http://x/y.png", InvalidArgument),
                     ("data:image/png,rawbytes", InvalidArgument), ("data:;base64,AAAA", InvalidArgument),
                     ("data:image/png;base64,@@@@", InvalidArgument), ("data:text/plain;base64,aGk=", Unsupported),
                     ("data:image/svg+xml;base64,PHN2Zy8+", Unsupported), ("data:image/png;base64,", InvalidArgument),
                     ("not a uri", InvalidArgument)]:
        with pytest.raises(err):
            parse_data_uri(bad, 1 << 20)
    with pytest.raises(TooLarge):
        parse_data_uri(uri, 100)
