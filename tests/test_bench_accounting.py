"""bench/accounting.py, the load test's useful work: the matmul weights it counts from the safetensors headers
are the ones the reference model multiplies by (transformers' modules), and an image's encoder cost follows
the patch grid the vision service's recipe gives it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.accounting import ModelWork, gemm_flops

MODELS = Path(__file__).resolve().parents[1] / "models"


def reference_matmul_weights(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Weights of every nn.Linear (and conv) a token or patch passes through, each shared tensor once."""
    seen, total = set(), 0
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d)) and not name.startswith(skip) \
                and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return total


@pytest.mark.parametrize("folder, cls, skip", [
    ("SmolLM2-135M-Instruct", "AutoModelForCausalLM", ()),           # tied: the head is the embedding table
    ("all-MiniLM-L6-v2", "AutoModel", ("pooler",)),                 # mean pooling: the pooler never runs
])
def test_token_flops_are_twice_the_matmul_weights(folder, cls, skip):
    import transformers
    path = MODELS / folder
    if not path.is_dir():
        pytest.skip(f"{path} is missing: run `make models`")
    model = getattr(transformers, cls).from_pretrained(path)
    assert ModelWork.from_folder(path).token_flops == 2 * reference_matmul_weights(model, skip)


def test_an_image_costs_its_encoder_at_the_recipes_patch_grid():
    import transformers

    from services.vision.recipes import Qwen2VLRecipe
    path = MODELS / "qwen2-vl-random"
    if not path.is_dir():
        pytest.skip(f"{path} is missing: run `make models`")
    rgb = np.zeros((300, 400, 3), dtype=np.uint8)
    work = ModelWork.from_folder(path, rgb)
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(path)
    visual = model.model.visual
    grid_t, grid_h, grid_w = Qwen2VLRecipe.from_folder(path)(rgb).grid
    patches = grid_t * grid_h * grid_w
    merger = reference_matmul_weights(visual.merger)
    per_patch = reference_matmul_weights(visual) - merger
    width, depth = visual.config.embed_dim, visual.config.depth
    assert work.image_flops == 2 * per_patch * patches + 2 * merger * patches / 4 + 4 * patches ** 2 * width * depth
    # The language model: every Linear but the vision tower's, the untied head included.
    assert work.token_flops == 2 * (reference_matmul_weights(model) - reference_matmul_weights(visual))
    assert ModelWork.from_folder(path).image_flops == 0       # no image given: no encoder counted


def test_the_probe_measures_a_positive_rate():
    assert 0 < gemm_flops(rounds=1, reps=1) < float("inf")
