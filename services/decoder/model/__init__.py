"""Decoder model code (Llama / Qwen2 / Qwen3 / Granite / OLMo 2, registry in families.py): ours at run time,
transformers only in tests."""
from services.decoder.model.config import ModelConfig
from services.decoder.model.decoder import CausalLM
from services.decoder.model.loader import load_model

__all__ = ["CausalLM", "ModelConfig", "load_model"]
