"""One image as the decoder receives it: projected rows, the post-merge grid and the vision service's hash.

The rows come from the vision service (or an in-process encoder) and are checked here before anything
else sees them: dtype float32, shape [t*h*w, hidden] for the grid it claims, finite values. A digest of
the rows themselves (not the caller's content_hash) is what salts the KV cache, so a caller cannot make
two different images share KV by sending the same hash.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument, Unsupported
from services.common.tensors import from_proto

PARAM = "images"


@dataclass(frozen=True)
class ImageInput:
    """rows [t*h*w, hidden] float32 CPU (row r is patch (tt, hh, ww) in row-major t, h, w order);
    grid (t, h, w) after the spatial merge; content_hash from the vision service (provenance);
    digest: sha256 of the rows' dtype, shape and bytes (what the prefix cache keys on)."""

    rows: torch.Tensor
    grid: tuple[int, int, int]
    content_hash: str
    digest: bytes

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


def rows_digest(rows: torch.Tensor) -> bytes:
    """sha256 over dtype, shape and the raw bytes of rows (C order)."""
    t = rows.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{list(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def make_image(rows: torch.Tensor, grid, content_hash: str, hidden_size: int, index: int = 0) -> ImageInput:
    """Validate one image. rows [t*h*w, hidden_size] float32; grid (t, h, w) ints >= 1 with t == 1.

    Raises InvalidArgument (shape, grid, hash, values) or Unsupported (t > 1: multi-frame input is video).
    """
    where = f"images[{index}]"
    try:
        t, h, w = (int(v) for v in grid)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{where}: grid must be three integers (t, h, w), got {grid!r}", param=PARAM) from exc
    if min(t, h, w) < 1:
        raise InvalidArgument(f"{where}: grid values must be >= 1, got {(t, h, w)}", param=PARAM)
    if t != 1:
        # Qwen2-VL resumes text after an image at max(h, w); for t > 1 (video) its rule differs, and video
        # inputs are not implemented, so computing them with the image rule would be silently wrong.
        raise Unsupported(f"{where}: grid t={t}; only single-frame images (t == 1) are supported", param=PARAM)
    if not isinstance(content_hash, str) or not content_hash:
        raise InvalidArgument(f"{where}: content_hash is required (the vision service's hash)", param=PARAM)
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.float32:
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise InvalidArgument(f"{where}: rows must be float32, got {got}", param=PARAM)
    want = (t * h * w, hidden_size)
    if tuple(rows.shape) != want:
        raise InvalidArgument(f"{where}: rows have shape {list(rows.shape)}; grid {(t, h, w)} and the model's "
                              f"hidden size need {list(want)}", param=PARAM)
    if not bool(torch.isfinite(rows).all()):
        raise InvalidArgument(f"{where}: rows contain NaN or infinite values", param=PARAM)
    rows = rows.detach().to("cpu").contiguous()
    return ImageInput(rows, (t, h, w), content_hash, rows_digest(rows))


def image_from_proto(msg, hidden_size: int, index: int = 0) -> ImageInput:
    """decoder.v1.ImageInput -> ImageInput. The Tensor codec checks bytes vs dtype and shape first."""
    where = f"images[{index}]"
    if not msg.HasField("rows"):
        raise InvalidArgument(f"{where}: rows are required", param=PARAM)
    if not msg.HasField("grid"):
        raise InvalidArgument(f"{where}: grid is required", param=PARAM)
    rows = from_proto(msg.rows, dtype=torch.float32, shape=(None, hidden_size), name=f"{where}.rows")
    return make_image(rows, (msg.grid.t, msg.grid.h, msg.grid.w), msg.content_hash, hidden_size, index)
