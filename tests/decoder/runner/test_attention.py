"""The per-step attention plan and the paged attention against plain causal attention, on both
decode backends (the C++ in-place operator and the torch gather path)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from services.common import native
from services.common.plan import ExecutionPlan
from services.decoder.kernels import paged_attention_cpu
from services.decoder.runner import attention
from services.decoder.runner.attention import (
    CPP,
    MAX_DECODE_PADDING,
    TORCH,
    AttentionPlan,
    PagedAttention,
    Workspace,
    choose_decode_backend,
)
from services.decoder.runner.kv_cache import KVCache
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

BS = 4


# Both backends always: the C++ toolchain is part of the install (g++ on the machine, ninja pinned), and
# tests/decoder/kernels fails outright without it, so a missing operator cannot pass as green.
BACKENDS = [TORCH, CPP]


def test_slot_mapping_follows_block_tables():
    spans = [(0, 6, [7, 2]), (5, 1, [3, 9]), (9, 3, [1, 4, 8])]
    plan = AttentionPlan.build(spans, BS, torch.device("cpu"), backend=TORCH)
    expected = [7 * 4 + p for p in range(4)] + [2 * 4 + 0, 2 * 4 + 1]       # positions 0..5
    expected += [9 * 4 + 1]                                                 # position 5
    expected += [8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3]                           # positions 9..11
    assert plan.slot_mapping.tolist() == expected
    assert AttentionPlan.build(spans, BS, torch.device("cpu"), backend=CPP).slot_mapping.tolist() == expected
    assert [(p.lo, p.hi) for p in plan.prefills] == [(0, 6), (7, 10)]
    assert plan.prefills[0].context_slots is None and plan.prefills[1].masks[None].shape == (3, 12)


def test_decode_groups_bound_padding_and_cover_every_row():
    lengths = [1, 2, 40, 38, 31, 29, 10, 9, 100]
    spans = [(n - 1, 1, list(range(100, 100 + -(-n // BS)))) for n in lengths]
    plan = AttentionPlan.build(spans, BS, torch.device("cpu"), backend=TORCH)
    rows = sorted(r for g in plan.decode for r in g.rows.tolist())
    assert rows == list(range(len(lengths)))
    for g in plan.decode:
        blocks = [-(-lengths[r] // BS) for r in g.rows.tolist()]
        assert g.num_blocks == max(blocks)
        assert min(blocks) >= (1 - MAX_DECODE_PADDING) * max(blocks)
    assert 1 < len(plan.decode) < len(lengths)


def test_cpp_plan_holds_every_decode_row_once():
    """Decode rows and the rows of short chunks go to the operator; longer chunks stay SDPA."""
    long = attention.PREFILL_IN_PLACE_MAX + 1
    first_long = attention.FIRST_CHUNK_IN_PLACE_MAX + 1
    first_table = list(range(100, 100 + -(-first_long // BS)))
    spans = [(0, 6, [7, 2]), (5, 1, [3, 9]), (9, 3, [1, 4, 8]), (0, 1, [6]), (12, 1, [10, 11, 12, 13, 5]),
             (2, long, list(range(20, 26))), (0, first_long, first_table)]
    plan = AttentionPlan.build(spans, BS, torch.device("cpu"), backend=CPP)
    rows = plan.decode_rows
    assert plan.decode == [] and rows.rows is None         # rows 0..11 are 0..B-1: the operator needs no index
    assert [(p.lo, p.hi) for p in plan.prefills] == [(12, 12 + long), (12 + long, 12 + long + first_long)]
    assert plan.prefills[1].context_slots is None and plan.prefills[1].masks[None] is None
    assert rows.context_lens.tolist() == [1, 2, 3, 4, 5, 6, 6, 10, 11, 12, 1, 13]
    assert rows.block_tables.dtype == torch.int32
    assert rows.block_tables.tolist() == [[7, 2, 0, 0]] * 6 + [[3, 9, 0, 0], [1, 4, 8, 0], [1, 4, 8, 0],
                                                                [1, 4, 8, 0], [6, 0, 0, 0], [10, 11, 12, 13]]
    assert plan.slot_mapping.tolist() == AttentionPlan.build(spans, BS, torch.device("cpu"),
                                                             backend=TORCH).slot_mapping.tolist()
    after = AttentionPlan.build([(0, first_long, first_table), (3, 1, [1])], BS, torch.device("cpu"), backend=CPP)
    assert after.decode_rows.rows.tolist() == [first_long]
    only_prefill = AttentionPlan.build([(0, first_long, first_table)], BS, torch.device("cpu"), backend=CPP)
    assert only_prefill.decode_rows is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_equals_causal_attention(backend):
    """Random q/k/v for 3 requests written over two steps; each row equals plain attention."""
    torch.manual_seed(0)
    h, kvh, d = 4, 2, 8
    cache = KVCache(1, 32, BS, kvh, d, torch.float32)
    seqs = {n: (torch.randn(n, h, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)) for n in (9, 5, 14)}
    tables = {9: [3, 11, 20], 5: [0, 7], 14: [30, 1, 17, 5]}
    ws = Workspace()
    # Step 1: prefixes (one whole, one cut), step 2: the rest, including a 1-token decode row.
    for cuts in ({9: (0, 6), 5: (0, 4), 14: (0, 9)}, {9: (6, 9), 5: (4, 5), 14: (9, 14)}):
        spans = [(a, b - a, tables[n]) for n, (a, b) in cuts.items()]
        plan = AttentionPlan.build(spans, BS, torch.device("cpu"), backend=backend)
        q, k, v = (torch.cat([seqs[n][i][a:b] for n, (a, b) in cuts.items()]) for i in range(3))
        out = PagedAttention(cache, plan, ws)(0, q, k, v)
        row = 0
        for n, (a, b) in cuts.items():
            sq, sk, sv = (t.transpose(0, 1)[None] for t in seqs[n])
            ref = F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
            # One layer: scores over head_dim 8, then a weighted sum over at most 14 keys.
            assert_close(out[row:row + b - a], ref[a:b], k=14, what=f"sequence of {n}")
            row += b - a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_agree_on_a_ragged_decode_step(dtype):
    """64 decode rows of very different lengths (several torch groups) plus a prefill chunk:
    the in-place operator and the gather path give the same attention."""
    torch.manual_seed(1)
    h, kvh, d, bs = 9, 3, 64, 16
    lengths = [1, 2, 15, 16, 17, 300, 299, 40, 150] * 7 + [1]
    need = [-(-(n + 1) // bs) for n in lengths] + [3]
    cache = KVCache(1, sum(need) + 5, bs, kvh, d, dtype)
    cache.k[0].normal_()
    cache.v[0].normal_()
    order = torch.randperm(sum(need) + 5).tolist()
    tables, used = [], 0
    for nb in need:
        tables.append(order[used:used + nb])
        used += nb
    spans = [(n, 1, t) for n, t in zip(lengths, tables, strict=False)] + [(20, 9, tables[-1])]
    n_tok = len(lengths) + 9
    q = torch.randn(n_tok, h, d).to(dtype)
    k, v = torch.randn(n_tok, kvh, d).to(dtype), torch.randn(n_tok, kvh, d).to(dtype)
    outs = {}
    for backend in (TORCH, CPP):
        plan = AttentionPlan.build(spans, bs, torch.device("cpu"), backend=backend)
        outs[backend] = PagedAttention(cache, plan, Workspace())(0, q, k, v)
    assert len(AttentionPlan.build(spans, bs, torch.device("cpu"), backend=TORCH).decode) > 1
    assert_close(outs[CPP], outs[TORCH], dtype=dtype, k=max(lengths) + 1)


def test_decode_backend_follows_the_pin_and_says_why(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="tessera")
    record = ExecutionPlan("attention=torch")
    assert choose_decode_backend(record, 9, 3, 64, 16, torch.float32) == TORCH
    assert record.get("attention").reason == "pinned by --fast-paths attention=torch"
    assert [r.levelname for r in caplog.records] == ["INFO"] and "attention: torch" in caplog.text

    def broken(build=True):
        raise native.BuildError("compiling paged_attention_cpu.cpp failed: boom")

    monkeypatch.setattr(paged_attention_cpu, "load", broken)
    caplog.clear()
    record = ExecutionPlan()
    assert choose_decode_backend(record, 9, 3, 64, 16, torch.float32) == TORCH
    assert "WARNING" in [r.levelname for r in caplog.records] and "boom" in caplog.text
    assert record.get("attention").reason == "unavailable: compiling paged_attention_cpu.cpp failed: boom"
    with pytest.raises(native.BuildError, match="boom"):
        choose_decode_backend(ExecutionPlan("attention=cpp"), 9, 3, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="attention='fast'"):
        ExecutionPlan("attention=fast")
    with pytest.raises(ValueError, match="expected cpp-paged or torch-gather"):
        AttentionPlan.build([(0, 1, [0])], BS, torch.device("cpu"), backend="fast")


def test_off_cpu_is_the_torch_path_untimed(monkeypatch):
    monkeypatch.setattr(attention, "_time_decode", lambda *a: pytest.fail("nothing is timed off CPU"))
    record = ExecutionPlan()
    assert choose_decode_backend(record, 9, 3, 64, 16, torch.float32, "meta") == TORCH
    assert record.get("attention").reason == "not on CPU"


def test_kv_cache_size():
    cache = KVCache(3, 10, BS, 2, 8, torch.bfloat16)
    assert cache.k[0].shape == (10, BS, 2, 8)
    assert cache.bytes == 10 * KVCache.bytes_per_block(3, BS, 2, 8, torch.bfloat16) == 10 * 2 * 3 * BS * 2 * 8 * 2


def test_choose_decode_backend_keeps_the_faster_measured_path(monkeypatch):
    for slow, fast in (("torch", "cpp"), ("cpp", "torch")):
        timed = []

        def fake(rows, *shape, slow=slow, timed=timed):
            timed.append((rows, shape))
            return {"cpp": 1e-3, "torch": 1e-3, slow: 2e-3}

        monkeypatch.setattr(attention, "_time_decode", fake)
        record = ExecutionPlan()
        assert choose_decode_backend(record, 9, 3, 64, 16, torch.bfloat16) == attention.NAMES[fast]
        assert [r for r, _ in timed] == list(attention.TIMING_ROWS)
        assert timed[0][1] == (9, 3, 64, 16, torch.bfloat16) and record.chosen("attention") == fast
        assert {(t.candidate, t.rows) for t in record.get("attention").timings} == \
            {(b, r) for b in ("cpp", "torch") for r in attention.TIMING_ROWS}
    # Within the tie margin the operator stays.
    monkeypatch.setattr(attention, "_time_decode", lambda rows, *shape: {"cpp": 1.02e-3, "torch": 1e-3})
    assert choose_decode_backend(ExecutionPlan(), 9, 3, 64, 16, torch.bfloat16) == CPP
    # Pinned: no timing.
    monkeypatch.setattr(attention, "_time_decode", lambda *a: pytest.fail("nothing is timed when pinned"))
    assert choose_decode_backend(ExecutionPlan("attention=cpp"), 9, 3, 64, 16, torch.float32) == CPP


def test_decode_timing_runs_both_paths(monkeypatch):
    monkeypatch.setattr(attention, "TIMING_CONTEXT", 40)
    took = attention._time_decode(3, 4, 2, 16, 4, torch.float32)
    assert set(took) == {"cpp", "torch"} and all(0 < t < 1 for t in took.values())
