"""The per-step attention plan and the paged attention against plain causal attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.decoder.runner.attention import MAX_DECODE_PADDING, AttentionPlan, PagedAttention, Workspace
from services.decoder.runner.kv_cache import KVCache
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

BS = 4


def test_slot_mapping_follows_block_tables():
    spans = [(0, 6, [7, 2]), (5, 1, [3, 9]), (9, 3, [1, 4, 8])]
    plan = AttentionPlan.build(spans, BS, torch.device("cpu"))
    expected = [7 * 4 + p for p in range(4)] + [2 * 4 + 0, 2 * 4 + 1]       # positions 0..5
    expected += [9 * 4 + 1]                                                 # position 5
    expected += [8 * 4 + 1, 8 * 4 + 2, 8 * 4 + 3]                           # positions 9..11
    assert plan.slot_mapping.tolist() == expected
    assert [(p.lo, p.hi) for p in plan.prefills] == [(0, 6), (7, 10)]
    assert plan.prefills[0].context_slots is None and plan.prefills[1].mask.shape == (3, 12)


def test_decode_groups_bound_padding_and_cover_every_row():
    lengths = [1, 2, 40, 38, 31, 29, 10, 9, 100]
    spans = [(n - 1, 1, list(range(100, 100 + -(-n // BS)))) for n in lengths]
    plan = AttentionPlan.build(spans, BS, torch.device("cpu"))
    rows = sorted(r for g in plan.decode for r in g.rows.tolist())
    assert rows == list(range(len(lengths)))
    for g in plan.decode:
        blocks = [-(-lengths[r] // BS) for r in g.rows.tolist()]
        assert g.num_blocks == max(blocks)
        assert min(blocks) >= (1 - MAX_DECODE_PADDING) * max(blocks)
    assert 1 < len(plan.decode) < len(lengths)


def test_paged_attention_equals_causal_attention():
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
        plan = AttentionPlan.build(spans, BS, torch.device("cpu"))
        q, k, v = (torch.cat([seqs[n][i][a:b] for n, (a, b) in cuts.items()]) for i in range(3))
        out = PagedAttention(cache, plan, ws)(0, q, k, v)
        row = 0
        for n, (a, b) in cuts.items():
            sq, sk, sv = (t.transpose(0, 1)[None] for t in seqs[n])
            ref = F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
            # One layer: scores over head_dim 8, then a weighted sum over at most 14 keys.
            assert_close(out[row:row + b - a], ref[a:b], k=14, what=f"sequence of {n}")
            row += b - a


def test_kv_cache_size():
    cache = KVCache(3, 10, BS, 2, 8, torch.bfloat16)
    assert cache.k[0].shape == (10, BS, 2, 8)
    assert cache.bytes == 10 * KVCache.bytes_per_block(3, BS, 2, 8, torch.bfloat16) == 10 * 2 * 3 * BS * 2 * 8 * 2
