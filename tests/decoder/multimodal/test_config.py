"""Qwen2-VL checkpoints as the decoder reads them: nested (transformers 5) and flat (transformers 4) configs,
both weight spellings, refused RoPE variants."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.model.config import ModelConfig
from services.decoder.model.loader import load_model
from tests.vision.checkpoints import token_ids


def raw(vl_ckpt) -> dict:
    return json.loads((vl_ckpt / "config.json").read_text())


def test_nested_config(vl_ckpt):
    cfg = ModelConfig.from_folder(vl_ckpt)
    ids = token_ids()
    assert cfg.family == "qwen2" and cfg.qkv_bias and cfg.mrope_sections == (2, 3, 3)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (64, 2, 384)
    assert cfg.vision.image_token_id == ids["<|image_pad|>"]
    assert cfg.vision.vision_start_token_id == ids["<|vision_start|>"]
    assert cfg.vision.spatial_merge_size == 2
    assert cfg.eos_token_ids == (ids["<|im_end|>"],)


def test_flat_transformers4_config_reads_the_same(vl_ckpt):
    nested = raw(vl_ckpt)
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    params = text.pop("rope_parameters")
    flat.update(text, model_type="qwen2_vl", rope_theta=params["rope_theta"],
                rope_scaling={"type": "mrope", "mrope_section": params["mrope_section"]})
    a, b = ModelConfig.from_dict(nested), ModelConfig.from_dict(flat)
    assert a == b


@pytest.mark.parametrize("change, error, match", [
    (lambda r: r["text_config"]["rope_parameters"].pop("mrope_section"), InvalidArgument, "mrope_section"),
    (lambda r: r["text_config"]["rope_parameters"].update(rope_type="yarn", factor=2.0), Unsupported, "yarn"),
    (lambda r: r.pop("image_token_id"), InvalidArgument, "image_token_id"),
    (lambda r: r["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2]), InvalidArgument, "head_dim"),
])
def test_refused_configs(vl_ckpt, change, error, match):
    r = copy.deepcopy(raw(vl_ckpt))
    change(r)
    with pytest.raises(error, match=match):
        ModelConfig.from_dict(r)


def test_language_model_prefix_loads_the_same_weights(vl_ckpt, tmp_path):
    """transformers' in-memory names (model.language_model.*, model.visual.*) load like the saved legacy ones."""
    folder = tmp_path / "renamed"
    shutil.copytree(vl_ckpt, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    a, b = load_model(vl_ckpt), load_model(folder)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    tensors["model.extra.weight"] = torch.zeros(1)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InvalidArgument, match="unexpected tensor"):
        load_model(folder)
