"""lora_apply: the torch path on CPU, the Triton kernels when forced (interpreter), and backend_name."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels import lora as lora_mod
from services.decoder.kernels.bgmv import bgmv_ref
from services.decoder.kernels.lora import backend_name, grouped_lora_ref, lora_apply, lora_torch
from services.decoder.kernels.lora_meta import build_lora_meta
from tests.tolerance import assert_close

from .lora_cases import SHAPE, adapters, inputs, truth

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

DECODE = torch.tensor([3, -1, 0, 1, 2, 3, 0, -1])
PREFILL = torch.tensor([1] * 12 + [-1] * 2 + [3] * 9 + [0])


def test_backend_name():
    assert backend_name("cpu") == "torch"
    assert backend_name(torch.device("cpu")) == "torch"
    assert backend_name("cuda") == "triton"
    assert backend_name(torch.device("cuda", 1)) == "triton"


@pytest.mark.parametrize("slots", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_dispatch_uses_torch_and_equals_ref(slots, dtype, monkeypatch):
    # Any kernel launch on CPU would be a dispatch bug: make it loud.
    def boom(*_a, **_k):
        raise AssertionError("Triton launched on CPU")

    monkeypatch.setattr(lora_mod, "bgmv", boom)
    monkeypatch.setattr(lora_mod, "sgmv", boom)
    ranks = [16, 1, 8, 5]
    A, B = adapters(ranks, 16, dtype=dtype)
    x, y = inputs(len(slots), dtype=dtype)
    target = y.clone()
    assert lora_apply(target, x, A, B, build_lora_meta(slots)) is target
    assert_close(target, bgmv_ref(y, x, A, B, slots), dtype=dtype, **SHAPE)
    assert_close(target, truth(y, x, A, B, slots, ranks), dtype=dtype, **SHAPE)
    assert torch.equal(target[slots < 0], y[slots < 0])


@pytest.mark.parametrize("slots", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_forced_triton_dispatch_picks_bgmv_or_sgmv(slots, monkeypatch):
    calls = []
    for name in ("bgmv", "sgmv"):
        real = getattr(lora_mod, name)
        monkeypatch.setattr(lora_mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    A, B = adapters([8, 8, 8, 8], 8)
    x, y = inputs(len(slots))
    meta = build_lora_meta(slots, block_m=16)
    out = lora_apply(y.clone(), x, A, B, meta, backend="triton")
    assert calls == ["bgmv" if meta.decode_only else "sgmv"]
    assert calls == (["bgmv"] if slots is DECODE else ["sgmv"])
    assert_close(out, bgmv_ref(y, x, A, B, slots), dtype=torch.float32, **SHAPE)


def test_torch_path_equals_spec_grouped_reference():
    A, B = adapters([4, 4, 4, 4], 4)
    x, y = inputs(len(PREFILL))
    out = lora_torch(y.clone(), x, A, B, build_lora_meta(PREFILL))
    assert_close(out, y + grouped_lora_ref(x, A, B, PREFILL), **SHAPE)


def test_all_base_rows_are_a_no_op():
    A, B = adapters([4, 4], 4)
    x, y = inputs(4)
    for backend in ("torch", "triton"):
        assert torch.equal(lora_apply(y.clone(), x, A, B, build_lora_meta([-1] * 4), backend=backend), y)


def test_unknown_backend_is_refused():
    A, B = adapters([4], 4)
    x, y = inputs(2)
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        lora_apply(y, x, A, B, build_lora_meta([0, 0]), backend="cuda")
