"""What a decoder over real gRPC looks like at rest, shared by the decoder's service tests.

Idle is the allocation invariant seen from outside (docs/design.md, invariant 10): no request running
or waiting, and every KV block back in the free pool.
"""
from __future__ import annotations

import time

import pytest

from services.common.pb import decoder_pb2, decoder_pb2_grpc


def stats(stub: decoder_pb2_grpc.DecoderServiceStub) -> decoder_pb2.EngineStats:
    """The engine's counters as GetModelInfo reports them."""
    return stub.GetModelInfo(decoder_pb2.GetModelInfoRequest()).stats


def wait_idle(stub: decoder_pb2_grpc.DecoderServiceStub, timeout: float = 20) -> decoder_pb2.EngineStats:
    """Polls until the engine is idle and returns its stats; fails the test if it is not within `timeout` s.

    Aborts and cancelled streams release their blocks on the engine's thread a moment after the client
    sees the end, hence the poll rather than one read.
    """
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = stats(stub)
        if s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks:
            return s
        time.sleep(0.05)
    pytest.fail(f"engine did not return to idle: {stats(stub)}")
