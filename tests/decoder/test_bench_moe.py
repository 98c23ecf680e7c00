"""bench/decoder.py (g), the MoE line, at a tiny shape: the checkpoint writer writes what transformers loads
as a Qwen3-MoE (and tessera computes the same logits from it), the bytes-per-step count is what the model
reads, and the line runs through to its llama.cpp half, which says why it did not run where llama.cpp is
not built."""
from __future__ import annotations

import json

import pytest
import torch

from bench import decoder as bench
from bench import moe_checkpoint
from bench.peers import llamacpp
from services.decoder.model import load_model
from services.decoder.model.linear import Linear
from services.decoder.model.moe import Experts
from tests.decoder.model.checkpoints import load_reference
from tests.decoder.model.test_model import causal_attention
from tests.tolerance import assert_close

TINY = {**moe_checkpoint.QWEN3_30B_A3B, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_experts": 16, "num_experts_per_tok": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 160}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return moe_checkpoint.write(tmp_path_factory.mktemp("bench") / "tiny-moe", 2, bench.SMOLLM2, shape=TINY)


def test_the_checkpoint_is_a_qwen3_moe_transformers_loads_whole(folder):
    from transformers import AutoModelForCausalLM
    ref, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load_model(folder, "fp32")
    ids = torch.randint(4, 160, (11,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ours.logits(ours(ours.embed(ids), torch.arange(11), causal_attention))
        want = load_reference(folder)(ids[None]).logits[0]
    assert_close(got, want, k=64, depth=3)
    assert moe_checkpoint.write(folder, 2, bench.SMOLLM2, shape=TINY) == folder       # kept, not rewritten


def test_decode_bytes_are_what_a_batch1_step_reads(folder):
    cfg = json.loads((folder / "config.json").read_text())
    model = load_model(folder, "bf16")
    linears = sum(m.weight.numel() for name, m in model.named_modules()
                  if isinstance(m, Linear) and name != "lm_head")
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    one_expert = experts[0].gate_up_proj[0].numel() + experts[0].down_proj[0].numel()
    parts = moe_checkpoint.decode_bytes(cfg, 2)
    assert parts["attention"] == 2 * linears
    assert parts["experts"] == 2 * len(experts) * TINY["num_experts_per_tok"] * one_expert
    assert parts["router"] == 2 * sum(layer.mlp.gate.weight.numel() for layer in model.model.layers)
    assert parts["head"] == 2 * model.lm_head.weight.numel()


def test_the_line_runs_and_says_why_llamacpp_did_not(folder, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(llamacpp, "LLAMA_SERVER", tmp_path / "no-llama-server")
    assert bench.moe_line(folder, [5, 9, 14, 3, 77], 4, 1, "") == []
    out = capsys.readouterr().out
    assert "(g) bf16 tiny-moe (2 layers, 4 of 16 experts): batch-1 decode tessera" in out
    assert f"(g) llama.cpp not run: {tmp_path / 'no-llama-server'} is missing: run `make bench-peers`" in out
    cmd, target = llamacpp.convert_command(folder, "bf16")
    assert target.name == "tiny-moe-BF16.gguf" and cmd[-4:] == ["--name", "tiny-moe", "--outtypes", "bf16"]
