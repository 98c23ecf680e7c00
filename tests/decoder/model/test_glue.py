"""The load-time choice of the elementwise glue (model/glue.py), and the model run on the C++ row ops."""
from __future__ import annotations

import pytest
import torch

from services.common.plan import ExecutionPlan
from services.decoder.model import load_model
from services.decoder.model.glue import choose
from services.decoder.model.layers import MLP, RMSNorm
from tests.decoder.model.checkpoints import CASES, TINY_SHAPE, build, load_reference
from tests.decoder.model.test_model import causal_attention, reference_attention
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build(root, name, seed=40 + i) for i, name in enumerate(CASES)}


def fused(folder, dtype: str = "fp32"):
    model = load_model(folder, dtype)
    model.fuse_projections()
    return model


def flags(model) -> tuple[set[bool], set[bool]]:
    return ({m.native for m in model.modules() if isinstance(m, RMSNorm)},
            {m.native for m in model.modules() if isinstance(m, MLP)})


def test_each_op_takes_the_path_that_timed_faster(folders):
    model = fused(folders["llama_mha_untied"])
    calls = []

    times = {("norm", "cpp"): 1e-3, ("norm", "torch"): 2e-3, ("act", "cpp"): 3e-3, ("act", "torch"): 2e-3}

    def timer(op, paths):
        took = {}
        for path, fn in paths.items():
            fn()                      # both paths still run: the timing calls must work
            calls.append((op, path))
            took[path] = times[op, path]
        return took

    record = ExecutionPlan()
    summary = choose(model, record, timer)
    assert sorted(calls) == [("act", "cpp"), ("act", "torch"), ("norm", "cpp"), ("norm", "torch")]
    assert summary == "norm cpp (1.00 vs 2.00 ms), silu*up torch (3.00 vs 2.00 ms) at 512 rows"
    assert flags(model) == ({True}, {False})
    assert record.chosen("glue.norm") == "cpp" and record.chosen("glue.act") == "torch"
    assert {(t.candidate, t.seconds) for t in record.get("glue.act").timings} == {("cpp", 3e-3), ("torch", 2e-3)}
    # Within the plan's tie margin the torch op stays.
    choose(model, ExecutionPlan(), lambda op, paths: {"cpp": 1.0, "torch": 1.04})
    assert flags(model) == ({False}, {False})


@pytest.mark.parametrize("pin", ["torch", "cpp"])
def test_a_pin_is_not_timed(folders, pin):
    model = fused(folders["llama_mha_untied"])
    record = ExecutionPlan(f"glue={pin}")
    summary = choose(model, record, lambda *a: pytest.fail("nothing is timed when pinned"))
    assert summary.startswith(pin) and flags(model) == ({pin == "cpp"}, {pin == "cpp"})
    assert record.chosen("glue.norm") == record.chosen("glue.act") == pin


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_logits_on_either_glue_match_transformers(folders, name, native):
    ours, ref = fused(folders[name]), load_reference(folders[name])
    ours.use_native_glue(norm=native, act=native)
    ids = torch.randint(0, ours.config.vocab_size, (19,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = ours.logits(ours(ours.embed(ids), torch.arange(19), reference_attention(ours.config)))
    assert_close(got, expected, **TINY_SHAPE)


def test_bf16_row_ops_track_the_torch_ops(folders):
    native, plain = fused(folders["qwen2_gqa2_odd_tied"], "bf16"), fused(folders["qwen2_gqa2_odd_tied"], "bf16")
    native.use_native_glue(norm=True, act=True)
    ids = torch.arange(23) % 150
    with torch.no_grad():
        a = native.logits(native(native.embed(ids), torch.arange(23), causal_attention))
        b = plain.logits(plain(plain.embed(ids), torch.arange(23), causal_attention))
    assert_close(a, b, dtype=torch.bfloat16, **TINY_SHAPE)
