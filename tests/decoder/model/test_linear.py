"""The few-row kernel's per-machine choice (model/linear.py, choose_gemv): made from measurement,
both paths agree, and an unavailable kernel leaves every Linear on its own path. lay_out_in_order
moves weights into one buffer per dtype in a given order and changes no value."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from services.decoder.kernels import gemv_cpu, native
from services.decoder.model.linear import ALIGN, Linear, choose_gemv, lay_out_in_order, quantize_linears
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics


def fake_timer(gemv_wins_up_to: dict[int, int]):
    """A GemvTimer where gemv_cpu is twice as fast up to gemv_wins_up_to[out_features] rows, else 1.5x slower."""
    def timer(group, rows):
        wins = rows <= gemv_wins_up_to.get(group[0].out_features, 0)
        return (2e-6, 1e-6) if wins else (1e-6, 1.5e-6)
    return timer


@pytest.mark.parametrize("quantized", [False, True])
def test_gemv_rows_follow_the_measurements(quantized):
    model = nn.Sequential(Linear(64, 96), Linear(64, 96), Linear(96, 32, bias=True), Linear(32, 160))
    if quantized:
        quantize_linears(model, "int8")
    summary = choose_gemv(model, fake_timer({96: 3, 32: 1}))
    assert [m.gemv_rows for m in model] == [3, 3, 1, 0]
    assert summary == "gemv rows<=3 on 96x64; rows<=1 on 32x96"
    # Both paths give the same results within the shared bound, at every row count either runs.
    for rows in range(1, 6):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        fast = model[0](x)
        model[0].gemv_rows = 0
        own = model[0](x)
        model[0].gemv_rows = 3
        # int8's own path meets bf16 activations; gemv_cpu keeps them fp32
        assert_close(fast, own, dtype=torch.bfloat16 if quantized else torch.float32, k=64)
    assert choose_gemv(model, fake_timer({})) == "gemv: none (the library path was as fast at every shape)"
    assert all(m.gemv_rows == 0 for m in model)


def test_weights_laid_out_in_order_keep_their_values_and_outputs():
    torch.manual_seed(0)
    fp32 = [Linear(64, 96), Linear(96, 40, bias=True), Linear(40, 64)]
    bf16 = [Linear(64, 48).to(torch.bfloat16), Linear(48, 64).to(torch.bfloat16)]
    int8 = nn.Sequential(Linear(64, 96), Linear(96, 64))
    quantize_linears(int8, "int8")
    linears = [bf16[0], fp32[2], *int8, fp32[0], bf16[1], fp32[1]]    # dtypes interleaved, order not the modules'
    held = [(m.qweight if m.qweight is not None else m.weight).clone() for m in linears]
    x = {64: torch.randn(3, 64), 96: torch.randn(3, 96), 40: torch.randn(3, 40), 48: torch.randn(3, 48)}
    before = [m(x[m.in_features].to(m.weight.dtype if m.qweight is None else torch.float32)) for m in linears]

    laid = lay_out_in_order(linears)

    weights = [m.qweight if m.qweight is not None else m.weight for m in linears]
    for w, old in zip(weights, held, strict=True):
        assert w.dtype == old.dtype and torch.equal(w, old) and w.is_contiguous()
    after = [m(x[m.in_features].to(m.weight.dtype if m.qweight is None else torch.float32)) for m in linears]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))      # a copy: same bits
    # One buffer per dtype, each weight on a cache line, in the order given, none overlapping.
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        group = [w for w in weights if w.dtype == dtype]
        assert len({w.untyped_storage().data_ptr() for w in group}) == 1
        starts = [w.data_ptr() for w in group]
        assert all(s % ALIGN == 0 for s in starts)
        ends = [w.data_ptr() + w.numel() * w.element_size() for w in group]
        assert all(end <= nxt for end, nxt in zip(ends, starts[1:], strict=False))
    assert laid >= sum(w.numel() * w.element_size() for w in weights)
    with pytest.raises(ValueError, match="hold a weight"):
        lay_out_in_order([fp32[0], Linear(8, 8, device="meta")])


def test_an_unavailable_kernel_is_reported_and_never_used(monkeypatch, caplog):
    def broken(build=True):
        raise native.BuildError("compiling gemv_cpu.cpp failed: boom")
    monkeypatch.setattr(gemv_cpu, "load", broken)
    model = nn.Sequential(Linear(64, 96))
    with caplog.at_level(logging.WARNING, logger="tessera.linear"):
        assert choose_gemv(model) == "gemv: unavailable (compiling gemv_cpu.cpp failed: boom)"
    assert model[0].gemv_rows == 0 and "boom" in caplog.text
