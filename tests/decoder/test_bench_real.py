"""bench/real_size.py and bench/quality.py at a tiny shape: the Llama-shaped checkpoint writer writes what
transformers loads as a tied-embedding Llama (and tessera computes the same logits from it), the bytes a step
reads are counted in the form each Linear computes with, and quality.py's teacher-forced log-probabilities
are transformers' at every position."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import decoder as bench
from bench import moe_checkpoint, quality, real_checkpoint
from services.decoder.model import load_model
from services.decoder.runner.runner import Runner
from tests.decoder.model.checkpoints import load_reference
from tests.decoder.model.test_model import causal_attention
from tests.tolerance import assert_close

TINY = {**real_checkpoint.LLAMA_32_1B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 160}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return moe_checkpoint.write(tmp_path_factory.mktemp("bench") / "tiny-llama", 2, bench.SMOLLM2, shape=TINY,
                                layer_tensors=real_checkpoint.tensors_of_layer)


def test_the_checkpoint_is_a_tied_llama_transformers_loads_whole(folder):
    from transformers import AutoModelForCausalLM
    ref, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert type(ref).__name__ == "LlamaForCausalLM" and ref.config.tie_word_embeddings
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load_model(folder, "fp32")
    ids = torch.randint(4, 160, (11,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ours.logits(ours(ours.embed(ids), torch.arange(11), causal_attention))
        want = load_reference(folder)(ids[None]).logits[0]
    assert_close(got, want, k=64, depth=2)


@pytest.mark.parametrize("variant", ["bf16", "int8", "int4"])
def test_decode_bytes_count_each_linear_in_the_form_it_computes_with(folder, variant):
    dtype, quantization = bench.VARIANTS[variant]
    runner = Runner.from_folder(folder, dtype, 16, 8, quantization=quantization, fast_paths="grouped_matmul=dequant")
    h, d, size = TINY["hidden_size"], TINY["head_dim"], TINY["intermediate_size"]
    layer = h * (TINY["num_attention_heads"] + 2 * TINY["num_key_value_heads"]) * d + TINY["num_attention_heads"] \
        * d * h + 3 * h * size
    weights = 2 * layer + TINY["vocab_size"] * h                     # the tied head reads the whole table
    if variant == "bf16":
        assert bench.decode_bytes(runner) == 2 * weights
    elif variant == "int4":                                          # 4-bit codes, fp16 scale and offset per 32
        assert bench.decode_bytes(runner) == weights // 2 + 4 * (weights // 32)
    else:                                                            # int8 codes and an fp32 scale per row
        rows = 2 * (TINY["num_attention_heads"] * d + 2 * TINY["num_key_value_heads"] * d + h + 2 * size + h) \
            + TINY["vocab_size"]
        assert bench.decode_bytes(runner) == weights + 4 * rows


def test_teacher_forced_logprobs_are_transformers_at_every_position(folder):
    runner = Runner.from_folder(folder, "fp32", 16, 4, fast_paths="")
    ids = torch.randint(4, 160, (40,), generator=torch.Generator().manual_seed(1))
    got = quality.window_logprobs(runner, ids.tolist())
    with torch.no_grad():
        want = torch.log_softmax(load_reference(folder)(ids[None]).logits[0].float(), dim=-1)
    assert got.shape == (40, TINY["vocab_size"])
    assert_close(got, want, k=64, depth=2)


def test_base_tokens_read_llama_perplexitys_file(tmp_path):
    tokens = np.arange(3 * 8, dtype=np.int32) + 100
    path = tmp_path / "base.kld"
    path.write_bytes(b"_logits_" + np.array([8, 160, 3], dtype=np.int32).tobytes() + tokens.tobytes() + b"\0" * 64)
    n_ctx, windows = quality.base_tokens(path)
    assert n_ctx == 8 and windows == tokens.reshape(3, 8).tolist()
