"""A character tokenizer over the tiny checkpoints' 160 ids (tests/decoder/model/checkpoints.py).

Ids 0..3 are the specials at the checkpoints' pad, bos and eos ids (2 and 3 both stop), 4..98 printable
ASCII, 99..159 the Latin-1 letters from U+00A1 on, one character each, so every id a model emits is text.
Enough for structured outputs (xgrammar reads it as a raw vocabulary) and for serving a tiny checkpoint
through the decoder process, which needs a tokenizer.json."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models

from tests.decoder.model.checkpoints import VOCAB

SPECIALS = ["<pad>", "<s>", "</s>", "<|end|>"]
STOP_IDS = (2, 3)


def char_tokenizer() -> Tokenizer:
    chars = [chr(c) for c in range(32, 127)] + [chr(0xA1 + i) for i in range(VOCAB - 99)]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


def write_char_tokenizer(folder: Path) -> Path:
    """folder/tokenizer.json and tokenizer_config.json (no chat template: prompts go as text or ids)."""
    char_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False}))
    return folder
