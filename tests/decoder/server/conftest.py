"""A tiny random Llama with SmolLM2's real tokenizer and chat template, and the decoder on it."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.loops import LoopThread

ROOT = Path(__file__).resolve().parents[3]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def need_smollm2() -> Path:
    if not (SMOLLM2 / "model.safetensors").is_file():
        pytest.fail(f"{SMOLLM2} is missing: run `make models` (make test does)")
    return SMOLLM2


def write_tiny_chat_llama(folder: Path, seed: int, init=None, **config) -> Path:
    """A random 2-layer Llama on SmolLM2's vocabulary (hidden 64, 4 heads; `config` overrides LlamaConfig's
    keys), with SmolLM2's tokenizer and chat template, saved to folder. init(name, param) fills each weight
    in place under torch.no_grad (default: normal(0, 0.2))."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    src = need_smollm2()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{
        "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            init(name, p) if init is not None else p.normal_(0, 0.2)
    model.save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    """Random 2-layer Llama whose vocabulary is SmolLM2's, so the real tokenizer and template apply."""
    return write_tiny_chat_llama(tmp_path_factory.mktemp("decoder") / "tiny-chat", seed=0)




@pytest.fixture(scope="module")
def decoder_server(tiny_chat_model):
    """The real decoder gRPC server on an ephemeral port: yields (address, servicer)."""
    from services.decoder.server.config import DecoderConfig, DecoderServerConfig
    from services.decoder.server.service import start
    loop = LoopThread()
    # Greedy steps take the argmax screen, pinned on whatever the timing would pick (model/screen.py).
    cfg = DecoderConfig(model=str(tiny_chat_model), num_blocks=64, block_size=4, max_num_batched_tokens=32,
                        max_n=4, fast_paths="screen=on")
    server, servicer = loop.run(start(DecoderServerConfig(host="127.0.0.1", port=0, reflection=True), cfg))
    yield f"127.0.0.1:{server.port}", servicer
    loop.run(server.stop(0))
    assert servicer.close()    # the engine, then the grammar compiler's threads
    loop.close()
