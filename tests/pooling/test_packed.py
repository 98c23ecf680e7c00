"""The packed BERT forward's attention grouping: optimal, and exact against transformers' padded forward."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from services.pooling import packed
from services.pooling.model import Sequence
from tests.pooling.conftest import MINILM_SHAPE
from tests.tolerance import assert_close


def cost(lengths, groups, call_cost):
    return sum(call_cost + (end - start) * lengths[end - 1] ** 2 for start, end in groups)


def every_split(n):
    """Every split of range(n) into contiguous non-empty groups."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        yield list(itertools.pairwise(bounds))


@pytest.mark.parametrize("seed", range(20))
def test_groups_are_the_cheapest_contiguous_split(seed):
    rng = random.Random(seed)
    lengths = sorted(rng.randint(1, 120) for _ in range(rng.randint(1, 9)))
    call_cost = rng.choice((0, 64, 1024, 10 ** 6))
    groups = packed.attention_groups(lengths, call_cost)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(groups + [(len(lengths), None)]))
    assert cost(lengths, groups, call_cost) == min(cost(lengths, g, call_cost) for g in every_split(len(lengths)))


def test_groups_cap_their_rows():
    groups = packed.attention_groups([7] * 200)
    assert max(end - start for start, end in groups) <= packed.MAX_GROUP_ROWS
    assert packed.attention_groups([5] * 3, call_cost=10 ** 6) == [(0, 3)]
    assert packed.attention_groups([1, 2, 300], call_cost=0) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.numerics
@pytest.mark.parametrize("cpp_attention", [False, True], ids=["grouped-sdpa", "cpp"])
def test_packed_forward_equals_transformers_in_any_row_order(minilm_dir, cpp_attention):
    """Rows of equal length (a view group), of mixed lengths (a gathered, masked group) and one long row
    alone, given shuffled: the result follows the callers' order and equals BertModel's padded forward,
    with attention pinned to either path (the load-time timing would pick one; both must be right)."""
    from services.pooling.folder import read_spec
    from services.pooling.model import Embedder
    model = Embedder(read_spec(minilm_dir, kind="embedding"),
                     fast_paths=f"encoder_attention={'cpp' if cpp_attention else 'torch'}")
    assert model.packed.cpp_attention == cpp_attention
    rng = random.Random(0)
    lengths = [6] * 5 + [9, 11, 14, 17, 30, 31, 33] + [250]
    rng.shuffle(lengths)
    seqs = [Sequence(tuple([101] + [rng.randrange(1000, 30000) for _ in range(n - 2)] + [102])) for n in lengths]
    ordered = sorted(lengths)
    kinds = [len(set(ordered[start:end])) == 1 for start, end in packed.attention_groups(ordered)]
    assert len(kinds) > 2 and True in kinds and False in kinds   # both kinds of group run
    hidden, mask = model.packed(seqs)
    batch = model._batch(seqs)
    with torch.inference_mode():
        ref = model.module(**batch).last_hidden_state
    assert torch.equal(mask, batch["attention_mask"].bool())
    visible = mask.unsqueeze(-1)
    assert_close(hidden * visible, ref * visible, **MINILM_SHAPE)
    assert not hidden[~mask].any()   # pad slots are zero
