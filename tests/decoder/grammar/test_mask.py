"""The two ways of applying masks compute the same logits, on all rows or some; the faster is chosen at load."""
from __future__ import annotations

import pytest
import torch

from services.decoder.grammar.mask import APPLY_PATHS, GrammarMasks, _probe_mask, apply_unpacked, apply_xgrammar


@pytest.mark.parametrize("vocab, indices", [(49152, list(range(8))), (49152, [1, 4, 6]), (1000, [0, 2])])
def test_both_apply_paths_agree(vocab, indices):
    bitmask = _probe_mask(8, vocab)
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab))
    a, b = logits.clone(), logits.clone()
    apply_xgrammar(a, bitmask, indices)
    apply_unpacked(b, bitmask, indices)
    assert torch.equal(a, b)
    untouched = [r for r in range(8) if r not in indices]
    assert torch.equal(a[untouched], logits[untouched])
    assert torch.isinf(a[indices]).any() and torch.isfinite(a[indices]).any(dim=1).all()


def test_the_faster_path_is_chosen_and_kept():
    masks = GrammarMasks()
    assert masks.choose(4096, "cpu", rows=4, reps=1) in APPLY_PATHS
    assert masks.apply_path in APPLY_PATHS
    with pytest.raises(ValueError):
        GrammarMasks("fast")


@pytest.mark.parametrize("pin", APPLY_PATHS)
def test_a_pinned_path_is_kept_untimed(pin, monkeypatch):
    from services.common.plan import ExecutionPlan
    from services.decoder.grammar import mask
    monkeypatch.setattr(mask, "fastest", lambda *a, **k: pytest.fail("a pinned path is not timed"))
    record = ExecutionPlan(f"grammar_mask={pin}")
    masks = GrammarMasks()
    assert masks.choose(4096, "cpu", record) == pin == masks.apply_path == record.chosen("grammar_mask")


def test_the_choice_follows_the_timing(monkeypatch):
    from services.common.plan import ExecutionPlan
    from services.decoder.grammar import mask
    monkeypatch.setattr(mask, "fastest", lambda calls, reps, sync=None: {"unpacked": 2.0, "xgrammar": 1.0})
    record = ExecutionPlan()
    assert GrammarMasks().choose(4096, "cpu", record) == "xgrammar"
    assert {t.candidate for t in record.get("grammar_mask").timings} == set(APPLY_PATHS)
    # Within the tie margin the unpacked path stays.
    monkeypatch.setattr(mask, "fastest", lambda calls, reps, sync=None: {"unpacked": 1.0, "xgrammar": 0.99})
    assert GrammarMasks().choose(4096, "cpu", ExecutionPlan()) == "unpacked"
