"""Multimodal prefill: validated image inputs, placeholder expansion with M-RoPE positions, cache salts."""
