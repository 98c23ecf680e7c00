"""--matmul-precision high on the decoder: every family's logits with the split products pinned on (each fp32
matmul the few-row kernel and the decode stack leave runs on the tile unit, services/common/split_products.py),
against transformers' fp32 model within the split products' bound; and what the plan records where it cannot
run. Pinned off is --matmul-precision highest, which every other test runs."""
from __future__ import annotations

import pytest
import torch

from services.common import tile_unit
from services.decoder.runner import Runner
from tests.common.test_tile_unit import needs_amx
from tests.decoder.families.test_features import chunked_logits
from tests.decoder.model.checkpoints import CASES, TINY_SHAPE, build, load_reference
from tests.tolerance import assert_close

pytestmark = pytest.mark.numerics

BLOCK = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    return {name: build(root, name, seed=i) for i, name in enumerate(CASES)}


@needs_amx
@pytest.mark.parametrize("name", list(CASES))
def test_split_products_track_transformers(folders, name):
    runner = Runner.from_folder(folders[name], "fp32", BLOCK, 64, matmul_precision="high",
                                fast_paths="split_products=on,gemv=off,decode_stack=off")
    splits = {c.name: c.chosen for c in runner.plan.choices if c.name.startswith("split_products ")}
    assert splits and set(splits.values()) == {"on rows>=1"}
    prompt = list(range(3, 16))
    rows, tokens = chunked_logits(runner, prompt, 3)
    with torch.no_grad():
        want = load_reference(folders[name])(torch.tensor([tokens])).logits[0, len(prompt) - 1:]
    for i, got in enumerate(rows):
        assert_close(got, want[i], **TINY_SHAPE, split=True, what=f"row {i}")


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_the_plan_says_why_nothing_is_split(folders, precision, monkeypatch):
    """Under highest, and under high on a CPU without the tile unit (made so here on any CPU), nothing splits and the
    plan's one entry says why."""
    monkeypatch.setattr(tile_unit, "amx", lambda: False)
    runner = Runner.from_folder(folders["llama_mha_untied"], "fp32", BLOCK, 16, matmul_precision=precision)
    reason = runner.plan.get("split_products").reason
    assert runner.plan.chosen("split_products") == "off"
    assert ("highest" if precision == "highest" else "no tile unit") in reason
    assert not any(c.name.startswith("split_products ") for c in runner.plan.choices)
