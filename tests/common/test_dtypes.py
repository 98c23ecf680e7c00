"""One dtype vocabulary: short names everywhere, the torch spellings as aliases, one mapping to torch."""
from __future__ import annotations

import pytest
import torch

from services.common import dtypes
from services.decoder.model.loader import resolve_dtype
from services.decoder.server.config import DecoderConfig
from services.pooling.config import PoolingConfig
from services.vision.config import VisionConfig


@pytest.mark.parametrize("name, short, dtype", [
    ("fp32", "fp32", torch.float32), ("float32", "fp32", torch.float32), ("BF16", "bf16", torch.bfloat16),
    ("bfloat16", "bf16", torch.bfloat16), ("fp16", "fp16", torch.float16), ("float16", "fp16", torch.float16),
])
def test_both_spellings_name_one_dtype(name, short, dtype):
    assert dtypes.canonical(name) == short
    assert dtypes.to_torch(name) is dtype
    assert dtypes.name_of(dtype) == short


def test_unknown_and_disallowed_names_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown dtype 'int4'") as info:
        dtypes.canonical("int4")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"choose from fp32 \(float32\), bf16 \(bfloat16\)$"):
        dtypes.to_torch("float16", ("fp32", "bf16"))
    with pytest.raises(ValueError):
        dtypes.name_of(torch.int8)
    assert set(dtypes.names(("fp32", "bf16"))) == {"fp32", "bf16", "float32", "bfloat16"}


def test_every_service_config_takes_either_spelling_and_keeps_the_short_one():
    assert DecoderConfig(model="m", dtype="bfloat16").dtype == "bf16"
    assert VisionConfig(model="m", dtype="float16").dtype == "fp16"
    assert PoolingConfig(embedding_model="m", dtype="float32").dtype == "fp32"
    assert PoolingConfig(embedding_model="m", dtype="bf16").dtype == "bf16"
    with pytest.raises(ValueError, match="unknown dtype 'fp16'"):   # the pooling forward has no fp16 path
        PoolingConfig(embedding_model="m", dtype="fp16")


def test_the_decoder_loader_speaks_the_same_vocabulary():
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert resolve_dtype(torch.float32, torch.device("cpu")) is torch.float32
