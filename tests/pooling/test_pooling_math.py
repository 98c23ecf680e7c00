"""Unit tests of the pooling math: padding is in neither the sum nor the divisor."""
from __future__ import annotations

import pytest
import torch

from services.pooling.pooling import pool_hidden, shorten
from tests.tolerance import assert_close

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics


def _hidden():
    h = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    h[0, 2] = 1000.0                      # a padded position with a huge value
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return h, mask


def test_mean_excludes_padding_from_sum_and_divisor():
    h, mask = _hidden()
    out = pool_hidden(h, mask, "mean", normalize=False)
    assert torch.equal(out[0], (h[0, 0] + h[0, 1]) / 2)
    assert torch.equal(out[1], h[1].mean(0))


def test_last_picks_last_visible_with_right_and_left_padding():
    h, mask = _hidden()
    assert torch.equal(pool_hidden(h, mask, "last", False)[0], h[0, 1])
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert torch.equal(pool_hidden(h, left, "last", False)[0], h[0, 2])


def test_cls_takes_first_and_refuses_left_padding():
    h, mask = _hidden()
    assert torch.equal(pool_hidden(h, mask, "cls", False), h[:, 0])
    with pytest.raises(ValueError, match="unpadded first token"):
        pool_hidden(h, torch.tensor([[0, 1, 1], [1, 1, 1]]), "cls", False)


def test_normalize_and_errors():
    h, mask = _hidden()
    out = pool_hidden(h, mask, "mean", normalize=True)
    assert_close(out.norm(dim=-1), torch.ones(2), k=2)
    with pytest.raises(ValueError, match="visible token"):
        pool_hidden(h, torch.tensor([[0, 0, 0], [1, 1, 1]]), "mean", False)
    with pytest.raises(ValueError, match="pooling mode"):
        pool_hidden(h, mask, "max", False)


def test_padding_width_does_not_change_the_result():
    torch.manual_seed(0)
    h = torch.randn(1, 4, 8)
    wide = torch.cat([h, torch.randn(1, 5, 8)], dim=1)
    narrow_mask, wide_mask = torch.ones(1, 4), torch.cat([torch.ones(1, 4), torch.zeros(1, 5)], 1)
    for mode in ("mean", "cls", "last"):
        assert_close(pool_hidden(h, narrow_mask, mode, True), pool_hidden(wide, wide_mask, mode, True), k=9, what=mode)


def test_shorten_renormalises_only_normalised_models():
    v = torch.nn.functional.normalize(torch.randn(3, 8), dim=-1)
    assert_close(shorten(v, 4, True).norm(dim=-1), torch.ones(3), k=8)
    assert torch.equal(shorten(v, 4, False), v[:, :4])
