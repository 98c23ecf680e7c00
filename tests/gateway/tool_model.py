"""A tiny random Qwen2 that speaks the hermes tool format: SmolLM2's tokenizer plus `<tool_call>` and
`</tool_call>` as added (not special) tokens, as Qwen2.5's tokenizer has them, and the test's hermes template
(tests/decoder/text/tool_template.py). Its words are noise; its template and tokens are a tool model's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer

from tests.decoder.server.conftest import need_smollm2
from tests.decoder.text.tool_template import HERMES_TEMPLATE

TOOL_TAGS = ("<tool_call>", "</tool_call>")


def write_tool_model(folder: Path) -> Path:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    src = need_smollm2()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tool_chat_model(tmp_path_factory) -> Path:
    return write_tool_model(tmp_path_factory.mktemp("tools") / "tiny-tools")

