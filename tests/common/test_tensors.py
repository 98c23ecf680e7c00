"""The tensor codec: every dtype round-trips; bad payloads are INVALID_ARGUMENT, never a crash."""
from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.pb import common_pb2
from services.common.tensors import from_proto, to_proto


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                                   torch.uint8])
@pytest.mark.parametrize("shape", [(0,), (3,), (2, 5), (2, 0, 4), ()])
def test_round_trip(dtype, shape):
    t = (torch.randn(shape) * 50).to(dtype)
    back = from_proto(to_proto(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_little_endian_contiguous_bytes():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).T      # non-contiguous view
    msg = to_proto(t)
    assert list(msg.shape) == [3, 2] and msg.dtype == common_pb2.DTYPE_FLOAT32
    assert msg.data == t.contiguous().numpy().astype("<f4").tobytes()


def test_decoded_tensor_is_a_private_writable_copy():
    msg = to_proto(torch.ones(4))
    t = from_proto(msg)
    t += 1
    assert torch.equal(from_proto(msg), torch.ones(4))


def test_expected_dtype_and_shape_with_free_dimensions():
    msg = to_proto(torch.zeros(7, 16))
    assert from_proto(msg, dtype=torch.float32, shape=(None, 16)).shape == (7, 16)
    with pytest.raises(InvalidArgument, match="dtype"):
        from_proto(msg, dtype=torch.float16, name="rows")
    with pytest.raises(InvalidArgument, match="shape") as info:
        from_proto(msg, shape=(None, 8), name="rows")
    assert info.value.param == "rows"
    with pytest.raises(InvalidArgument, match="shape"):
        from_proto(msg, shape=(7, 16, 1))


@pytest.mark.parametrize("msg, match", [
    (common_pb2.Tensor(data=b"\0" * 8, dtype=common_pb2.DTYPE_UNSPECIFIED, shape=[2]), "unknown dtype"),
    (common_pb2.Tensor(data=b"\0" * 7, dtype=common_pb2.DTYPE_FLOAT32, shape=[2]), "bytes"),
    (common_pb2.Tensor(data=b"\0" * 8, dtype=common_pb2.DTYPE_FLOAT32, shape=[3]), "bytes"),
    (common_pb2.Tensor(data=b"", dtype=common_pb2.DTYPE_FLOAT32, shape=[-1]), "negative"),
    (common_pb2.Tensor(data=b"\0" * 8, dtype=99, shape=[2]), "unknown dtype"),
])
def test_bad_payloads_are_invalid_argument(msg, match):
    with pytest.raises(InvalidArgument, match=match):
        from_proto(msg)


def test_unsupported_torch_dtype_is_refused():
    with pytest.raises(InvalidArgument):
        to_proto(torch.zeros(2, dtype=torch.complex64))
