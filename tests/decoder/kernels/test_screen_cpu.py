"""The screen's candidate pass (kernels/screen_cpu.cpp) against its torch reference, and its refusals."""
from __future__ import annotations

import pytest
import torch

from services.decoder.kernels.screen_cpu import candidates, candidates_ref

# Only compares and one multiply-add per element, in the same fp32 order on both sides: exact.
pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 160), (64, 5000), (5, 49152)])
def test_candidates_match_the_reference(rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    scores = 3 * torch.randn(rows, vocab, generator=g)
    radius = 0.05 * torch.rand(rows, generator=g)
    norms = torch.rand(vocab, generator=g) + 0.5
    got = candidates(scores, radius, norms)
    assert torch.equal(got, candidates_ref(scores, radius, norms))
    # Every row keeps at least its own best lower bound's column, and its true maximum.
    assert set(got[:, 0].tolist()) == set(range(rows))
    for r in range(rows):
        assert int(scores[r].argmax()) in got[got[:, 0] == r, 1].tolist()


def test_zero_radius_keeps_exactly_the_tied_maxima():
    scores = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.25, 0.5]])
    got = candidates(scores, torch.zeros(2), torch.ones(4))
    assert got.tolist() == [[0, 1], [0, 2], [1, 0], [1, 1], [1, 3]]


def test_a_wide_radius_keeps_every_column():
    scores = torch.randn(2, 50)
    got = candidates(scores, torch.full((2,), 1e3), torch.ones(50))
    assert got.shape == (100, 2)


def test_refuses_bad_shapes_and_dtypes():
    with pytest.raises(RuntimeError, match="fp32"):
        candidates(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2), torch.ones(4))
    with pytest.raises(RuntimeError, match="radius"):
        candidates(torch.zeros(2, 4), torch.zeros(3), torch.ones(4))
    with pytest.raises(RuntimeError, match="norms"):
        candidates(torch.zeros(2, 4), torch.zeros(2), torch.ones(5))
