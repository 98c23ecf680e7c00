"""A bad image's error names what is wrong in plain words: no Python object repr (PIL's message carries
`<_io.BytesIO object at 0x...>`), no address of the process."""
from __future__ import annotations

import io

import pytest
from PIL import Image

from services.common.errors import InvalidArgument
from services.vision.image import Limits, decode

LIMITS = Limits(max_bytes=1 << 20, max_pixels=1 << 20)


def truncated_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (9, 9, 9)).save(buf, "PNG")
    return buf.getvalue()[:80]


@pytest.mark.parametrize("data", [b"definitely not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, truncated_png()],
                         ids=["text", "bad-header", "truncated"])
def test_a_bad_image_error_has_no_object_repr(data):
    with pytest.raises(InvalidArgument) as refused:
        decode(data, LIMITS, param="messages[0].content[1]")
    message = str(refused.value.message)
    assert "0x" not in message and "<" not in message and "object at" not in message, message
    assert message.startswith(("not a decodable", "image could not be decoded")), message
