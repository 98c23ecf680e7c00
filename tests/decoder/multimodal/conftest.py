"""Fixtures: one tiny random Qwen2-VL checkpoint (written with save_pretrained), our vision encoder on it,
transformers' Qwen2VLForConditionalGeneration on it (the reference), and real photos as images."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.vision.checkpoints import write_qwen2_vl


def photo(name: str) -> bytes:
    """A real photo shipped with scikit-image (found without importing skimage)."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        pytest.fail("scikit-image's data files are missing: run `make install`")
    return (Path(spec.origin).parent / "data" / name).read_bytes()


@pytest.fixture(scope="session")
def vl_ckpt(tmp_path_factory) -> Path:
    return write_qwen2_vl(tmp_path_factory.mktemp("multimodal") / "tiny-qwen2-vl", seed=3)


@pytest.fixture(scope="session")
def reference(vl_ckpt):
    from transformers import Qwen2VLForConditionalGeneration
    return Qwen2VLForConditionalGeneration.from_pretrained(vl_ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def encoder(vl_ckpt):
    from services.vision import encoder as encoder_mod
    return encoder_mod.load(vl_ckpt)
