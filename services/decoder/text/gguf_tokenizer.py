"""The tokenizer and chat template inside a GGUF file, as a tokenizer folder the decoder's Tokenizer reads.

A GGUF file carries its vocabulary (tokenizer.ggml.model, tokens, merges or scores, token types, special ids)
and usually its chat template (tokenizer.chat_template). transformers rebuilds a fast tokenizer from those
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, the same tokenizer vLLM serves a GGUF with); it is saved
to a folder (tokenizer.json, tokenizer_config.json, chat_template.jinja) that text/tokenizer.py and
text/chat_template.py then read as any other, so ids, special tokens and the template equal transformers'.
transformers is imported only here, at load, and only for a GGUF file served without --tokenizer.
"""
from __future__ import annotations

from pathlib import Path


def write_folder(path: str | Path, folder: Path) -> Path:
    """Save the GGUF file's tokenizer and chat template as a tokenizer folder in `folder`; returns it."""
    from transformers import AutoTokenizer

    path = Path(path)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(folder))
    return folder
