"""The C++ encoder attention over packed sequences against its torch reference (pooling/attention_cpu),
and the packed forward's load-time choice between it and the grouped SDPA."""
from __future__ import annotations

import pytest
import torch

from services.common import native
from services.common.plan import ExecutionPlan
from services.pooling import attention_cpu, packed
from services.pooling.attention_cpu import attention, attention_ref
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module", autouse=True)
def operator():
    try:
        return attention_cpu.load()
    except native.ToolchainMissing as e:
        # g++ is on every machine this project targets and ninja is pinned: a missing toolchain is a
        # broken install, not a reason to pass without testing the operator.
        pytest.fail(f"no toolchain for the C++ operator: {e}")


def case(lengths: list[int], heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim, generator=g).to(dtype)
    return qkv, torch.tensor([0] + lengths).cumsum(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [(12, 32), (4, 64), (2, 8), (3, 80)])   # 80: wider than the register path
def test_ragged_batch_matches_reference(dtype, heads, head_dim):
    lengths = [1, 5, 16, 17, 31, 33, 64, 2]   # around the 16-key and 4-query blocks, in no order
    qkv, offsets = case(lengths, heads, head_dim, dtype)
    out = attention(qkv, offsets, heads)
    assert out.dtype == dtype and out.shape == (sum(lengths), heads * head_dim)
    assert_close(out, attention_ref(qkv, offsets, heads), dtype=dtype, k=max(max(lengths), head_dim))


def test_a_long_sequence_and_large_scores_stay_finite():
    """Scores of +-1e4, far past 88 where exp overflows fp32: subtracting each query's max keeps the
    softmax finite. Only finiteness is checked there: a score's rounding error grows with its size, so
    near-ties differ between any two summation orders by more than the shared bound allows. Scores of
    a few tens are compared with the reference over a 300-token sequence."""
    qkv, offsets = case([300, 7], 2, 32, torch.float32)
    huge = qkv.clone()
    huge[:, :64] *= 300.0     # q only
    assert torch.isfinite(attention(huge, offsets, 2)).all()
    qkv[:, :64] *= 10.0       # scores up to ~45
    out = attention(qkv, offsets, 2)
    assert torch.isfinite(out).all()
    assert_close(out, attention_ref(qkv, offsets, 2), k=300)


def test_a_sequence_attends_only_to_itself():
    """Changing one sequence's tokens leaves every other sequence's output bit for bit the same, and a
    sequence's result does not depend on the batch around it or on the thread count."""
    lengths = [9, 23, 4, 40]
    qkv, offsets = case(lengths, 4, 32, torch.float32)
    base = attention(qkv, offsets, 4)
    changed = qkv.clone()
    changed[9:32] = torch.randn(23, qkv.shape[1])
    other = attention(changed, offsets, 4)
    keep = torch.ones(qkv.shape[0], dtype=torch.bool)
    keep[9:32] = False
    assert torch.equal(base[keep], other[keep]) and not torch.equal(base[~keep], other[~keep])
    alone = attention(qkv[32:36].clone(), torch.tensor([0, 4]), 4)
    assert torch.equal(alone, base[32:36])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attention(qkv, offsets, 4), base)
    finally:
        torch.set_num_threads(threads)


def test_empty_sequences_are_allowed_and_bad_offsets_raise():
    qkv, _ = case([3, 4], 2, 16, torch.float32)
    out = attention(qkv, torch.tensor([0, 3, 3, 7]), 2)
    assert_close(out, attention_ref(qkv, torch.tensor([0, 3, 7]), 2), k=16)
    for offsets, message in ((torch.tensor([0, 5, 3, 7]), "must not decrease"),
                             (torch.tensor([0, 3, 6]), "from 0 to 7"),
                             (torch.tensor([1, 3, 7]), "from 0 to 7"),
                             (torch.tensor([0, 3, 7], dtype=torch.int32), "int64")):
        with pytest.raises(RuntimeError, match=message):
            attention(qkv, offsets, 2)
    with pytest.raises(RuntimeError, match="3 \\* heads \\* D"):
        attention(qkv, torch.tensor([0, 3, 7]), 5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        attention(qkv.double(), torch.tensor([0, 3, 7]), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_choice_is_timed_and_both_paths_agree(dtype):
    """The packed forward takes the operator only when it timed faster at load, and either choice gives
    the grouped SDPA's result within the shared tolerance."""
    record = ExecutionPlan()
    use, summary = packed.choose_attention(4, 16, dtype, record)
    assert summary.startswith("cpp (timed" if use else "torch-grouped (timed") and " vs grouped " in summary
    assert record.chosen("encoder_attention") == ("cpp" if use else "torch")
    ran = []

    def timer(seconds):
        return lambda calls: {name: (fn(), ran.append(name), seconds[name])[-1] for name, fn in calls.items()}
    assert packed.choose_attention(4, 16, dtype, record, timer({"cpp": 0.005, "torch": 0.001})) == \
        (False, "torch-grouped (timed cpp 5.00 vs grouped 1.00 ms)")
    assert packed.choose_attention(4, 16, dtype, record, timer({"cpp": 0.001, "torch": 0.002})) == \
        (True, "cpp (timed cpp 1.00 vs grouped 2.00 ms)")
    # Within the plan's tie margin the grouped SDPA stays.
    assert packed.choose_attention(4, 16, dtype, record, timer({"cpp": 0.00099, "torch": 0.001}))[0] is False
    assert ran == ["cpp", "torch"] * 3
    for pin in ("cpp", "torch"):
        pinned = ExecutionPlan(f"encoder_attention={pin}")
        assert packed.choose_attention(4, 16, dtype, pinned, lambda calls: pytest.fail("pinned: not timed"))[0] == \
            (pin == "cpp")
    lengths = sorted([3, 17, 9, 30, 30, 1])
    qkv, offsets = case(lengths, 4, 16, dtype)
    grouped = torch.empty(qkv.shape[0], 64, dtype=dtype)
    for group in packed._groups(lengths):
        group.attend(qkv, grouped, 4)
    assert_close(attention(qkv, offsets, 4), grouped, dtype=dtype, k=30)


def test_unavailable_operator_falls_back_to_grouped_and_says_why(monkeypatch, caplog):
    def broken(build=True):
        raise native.BuildError("compiling attention_cpu.cpp failed: no space left")
    monkeypatch.setattr(attention_cpu, "load", broken)
    use, summary = packed.choose_attention(4, 16, torch.float32, ExecutionPlan())
    assert not use and summary == "torch-grouped (cpp unavailable: compiling attention_cpu.cpp failed: no space left)"
    assert "encoder attention operator unavailable" in caplog.text
