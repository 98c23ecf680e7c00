"""A Llama 3.2-shaped checkpoint (rope_type llama3, tied embeddings, GQA) end to end: the decoder service as
`make up` starts it, behind the real gateway, driven by the `openai` client; greedy completions equal
transformers' greedy generate on the same folder, as text."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from tests.decoder.server.conftest import write_tiny_chat_llama
from tests.gateway.chat_fleet import MODEL, chat_fleet, wait_idle

# Llama 3.2's recipe scaled to head_dim 16: with theta 500000 and 64 pretraining positions, the 8 rotary pairs
# fall in all three llama3 bands (kept, smoothed, divided by factor).
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
TEXTS = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):"]
NEW = 16


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    """A random 2-layer Llama 3.2-style model on SmolLM2's vocabulary, tokenizer and chat template."""
    def init(name, p):
        p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))

    return write_tiny_chat_llama(tmp_path_factory.mktemp("llama32") / "tiny-llama32", seed=1, init=init,
                                 num_key_value_heads=1, max_position_embeddings=1024, rope_parameters=ROPE)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, llama32):
    with chat_fleet(llama32, tmp_path_factory.mktemp("logs")) as f:
        yield f


def reference(folder, ids: list[int]) -> tuple[str, str]:
    """transformers' greedy continuation of ids, as text, and its finish reason."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW, eos_token_id=2, pad_token_id=2)[0, len(ids):]
    new = out.tolist()
    stopped = 2 in new
    new = new[:new.index(2)] if stopped else new
    text = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(new, skip_special_tokens=True)
    return text, "stop" if stopped else "length"


def test_greedy_completions_equal_transformers(fleet, llama32):
    tokenizer = Tokenizer.from_file(str(llama32 / "tokenizer.json"))
    card = fleet["client"].models.retrieve(MODEL)
    assert card.model_extra["kind"] == "generation"
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        got = fleet["client"].completions.create(model=MODEL, prompt=ids, max_tokens=NEW, temperature=0)
        expected, reason = reference(llama32, ids)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (expected, reason), text
    wait_idle(fleet)
    log = (fleet["logs"] / "decoder.log").read_text()
    assert "RoPE llama3 theta=500000 factor=32 original_max_position_embeddings=64" in log
