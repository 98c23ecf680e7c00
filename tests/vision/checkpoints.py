"""Tiny random-weight Qwen2-VL and Qwen2.5-VL checkpoints written with transformers' save_pretrained (no hub).

`write_qwen2_vl(folder)` (and `write_qwen2_5_vl(folder)`) writes a complete folder the vision service
and the decoder can both load:
- config.json + model.safetensors (Qwen2VLForConditionalGeneration or Qwen2_5_VLForConditionalGeneration,
  `visual.*` keys);
- preprocessor_config.json (Qwen2VLImageProcessorPil);
- tokenizer.json / tokenizer_config.json / chat_template.jinja: a byte-level
  tokenizer (256 byte tokens, no merges) plus Qwen2-VL's special tokens, with
  Qwen2-VL's chat template, so prompts with images tokenize like the real model's.

Random weights prove plumbing and numerics against transformers, not answers.
"""
from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
BYTE_VOCAB = 256
VOCAB_SIZE = 384  # bytes + special tokens, rounded up

# Qwen2-VL's chat template (system default, one <|vision_start|><|image_pad|><|vision_end|> per image).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# A tiny tower: 2 blocks, width 32, 4 heads of 8 (2D rotary needs head_dim % 4 == 0).
TINY_VISION = dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2)
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)
# A tiny Qwen2.5-VL tower: 4 blocks of width 32 (4 heads of 8), blocks 1 and 3 attend over the whole image,
# 0 and 2 within windows of 112 pixels = 4x4 merge groups, so a 224x224 photo (8x8 groups) has 4 windows
# and other sizes windows cut short at the edges.
TINY_VISION_2_5 = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=4, window_size=112,
                       fullatt_block_indexes=[1, 3])
# Accumulation shapes for tests/tolerance.py: the tower's longest dot product is its patch
# embedding (3 channels x 2 frames x 14 x 14 = 1176); depth = 2 blocks + patch embedding + merger.
# An image chat adds the text model's 2 layers + LM head after the tower.
VISION_SHAPE = {"k": 1176, "depth": 4}
VL_SHAPE = {"k": 1176, "depth": 7}
VISION_SHAPE_2_5 = {"k": 1176, "depth": 6}    # 4 blocks + patch embedding + merger
VL_SHAPE_2_5 = {"k": 1176, "depth": 9}
# Small pixel budget keeps the tests fast: a 512x512 photo becomes 224x224 (16x16 patches, 64 rows).
TINY_MAX_PIXELS = 224 * 224


def token_ids() -> dict[str, int]:
    """Special token -> id in the tiny tokenizer (they follow the 256 byte tokens)."""
    return {tok: BYTE_VOCAB + i for i, tok in enumerate(SPECIAL_TOKENS)}


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: ord(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(folder)


def _text_config(text: dict | None, mrope_section: tuple[int, int, int]) -> dict:
    ids = token_ids()
    return {**TINY_TEXT, **(text or {}), "vocab_size": VOCAB_SIZE, "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(mrope_section)}}


def _token_kwargs() -> dict:
    ids = token_ids()
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def _save(folder: Path, model, *, weight_std: float, min_pixels: int, max_pixels: int, tokenizer: bool) -> Path:
    """Random weights (from the seeded generator that built `model`) into it, then the whole folder:
    weights, preprocessor, tokenizer."""
    from transformers import Qwen2VLImageProcessorPil

    model = model.eval()
    # transformers' 0.02 init leaves attention nearly uniform, which would hide position bugs:
    # larger weights make attention sharp, so rotary order and segment boundaries are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("norm" in name or "ln_q" in name):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, weight_std)
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(folder)
    if tokenizer:
        write_tokenizer(folder)
    return folder


def write_qwen2_vl(folder: Path, *, seed: int = 0, vision: dict | None = None, text: dict | None = None,
                   min_pixels: int = 56 * 56, max_pixels: int = TINY_MAX_PIXELS,
                   mrope_section: tuple[int, int, int] = (2, 3, 3), tokenizer: bool = True,
                   weight_std: float = 0.2) -> Path:
    """Write a random Qwen2-VL checkpoint folder; returns it. vision/text override the tiny sizes."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text_cfg = _text_config(text, mrope_section)
    vision_cfg = {**TINY_VISION, **(vision or {}), "hidden_size": text_cfg["hidden_size"]}
    config = Qwen2VLConfig(text_config=text_cfg, vision_config=vision_cfg, **_token_kwargs())
    torch.manual_seed(seed)
    return _save(folder, Qwen2VLForConditionalGeneration(config), weight_std=weight_std,
                 min_pixels=min_pixels, max_pixels=max_pixels, tokenizer=tokenizer)


def write_qwen2_5_vl(folder: Path, *, seed: int = 0, vision: dict | None = None, text: dict | None = None,
                     min_pixels: int = 56 * 56, max_pixels: int = TINY_MAX_PIXELS,
                     mrope_section: tuple[int, int, int] = (2, 3, 3), tokenizer: bool = True,
                     weight_std: float = 0.2) -> Path:
    """Write a random Qwen2.5-VL checkpoint folder (TINY_VISION_2_5 tower); returns it."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text_cfg = _text_config(text, mrope_section)
    vision_cfg = {**TINY_VISION_2_5, **(vision or {}), "out_hidden_size": text_cfg["hidden_size"]}
    config = Qwen2_5_VLConfig(text_config=text_cfg, vision_config=vision_cfg, **_token_kwargs())
    torch.manual_seed(seed)
    return _save(folder, Qwen2_5_VLForConditionalGeneration(config), weight_std=weight_std,
                 min_pixels=min_pixels, max_pixels=max_pixels, tokenizer=tokenizer)
