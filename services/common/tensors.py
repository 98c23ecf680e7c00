"""The tensor codec: common.v1.Tensor <-> torch.Tensor, dtype and shape checked.

A payload whose byte length, dtype or shape is wrong is an InvalidArgument,
never a crash deep inside a model.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import InvalidArgument
from .pb import common_pb2

_TO_TORCH = {
    common_pb2.DTYPE_FLOAT32: torch.float32,
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    common_pb2.DTYPE_INT64: torch.int64,
    common_pb2.DTYPE_INT32: torch.int32,
    common_pb2.DTYPE_UINT8: torch.uint8,
}
_TO_PROTO = {v: k for k, v in _TO_TORCH.items()}


def to_proto(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Any-shape CPU-copyable tensor -> Tensor (little-endian, C order)."""
    if tensor.dtype not in _TO_PROTO:
        raise InvalidArgument(f"dtype {tensor.dtype} cannot travel as a Tensor")
    t = tensor.detach().to("cpu").contiguous()
    # reshape(-1) first: a 0-d tensor cannot be viewed as bytes directly.
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return common_pb2.Tensor(data=data, dtype=_TO_PROTO[t.dtype], shape=list(t.shape))


def from_proto(msg: common_pb2.Tensor, *, dtype: torch.dtype | None = None,
               shape: Sequence[int | None] | None = None, name: str = "tensor") -> torch.Tensor:
    """Tensor -> torch.Tensor (a private copy).

    dtype: required element type, if given. shape: required shape, None entries
    are free dimensions (e.g. (None, 1536) for [N, 1536]).
    """
    if msg.dtype not in _TO_TORCH:
        raise InvalidArgument(f"{name}: unknown dtype {msg.dtype}", param=name)
    got = _TO_TORCH[msg.dtype]
    if dtype is not None and got != dtype:
        raise InvalidArgument(f"{name}: dtype {got} where {dtype} is required", param=name)
    dims = list(msg.shape)
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{name}: negative dimension in shape {dims}", param=name)
    if shape is not None and (len(dims) != len(shape) or any(
            want is not None and want != d for want, d in zip(shape, dims, strict=True))):
        raise InvalidArgument(f"{name}: shape {dims} does not match {list(shape)}", param=name)
    count = 1
    for d in dims:
        count *= d
    itemsize = torch.empty((), dtype=got).element_size()
    if len(msg.data) != count * itemsize:
        raise InvalidArgument(
            f"{name}: {len(msg.data)} bytes for shape {dims} of {got} (want {count * itemsize})",
            param=name)
    if count == 0:
        return torch.empty(dims, dtype=got)
    flat = torch.frombuffer(bytearray(msg.data), dtype=got)
    return flat.reshape(dims)
