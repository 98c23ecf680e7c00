"""Phi-3 and Phi-4-mini (model_type "phi3"): Llama's layer over fused checkpoint projections.

transformers' Phi3ForCausalLM computes Llama's block exactly (RMSNorm, attention, SiLU-gated MLP, the same
residual adds; its `up * silu(gate)` is the same product), but stores
    self_attn.qkv_proj   [(H + 2 KVH) * D, hidden]: q | k | v rows
    mlp.gate_up_proj     [2 * I, hidden]: gate | up rows
The loader splits those rows into q/k/v_proj and gate/up_proj (`checkpoint_fused`), so everything
downstream (fusing them again for one matmul, quantization, the adapter bank's per-projection slots) is
Llama's; a PEFT adapter on qkv_proj / gate_up_proj is split the same way (lora/peft_loader.py).

What Phi-3 adds is in its config: longrope (model/rope.py), and Phi-4-mini's partial_rotary_factor (0.75:
only the first 3/4 of each head rotate, model/rotary.py). The C++ decode stack rotates whole heads, so a
partial-rotary checkpoint decodes through these layers (`unsupported`).
"""
from __future__ import annotations

from services.decoder.model.decoder import CausalLM


class Phi3(CausalLM):
    checkpoint_fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def unsupported(self) -> dict[str, str]:
        cfg = self.config
        rotary = cfg.rope.rotary_dim(cfg.head_dim) if cfg.rope is not None else cfg.head_dim
        if rotary == cfg.head_dim:
            return {}
        return {"decode_stack": f"phi3's partial rotary (partial_rotary_factor {cfg.rope.partial_rotary_factor:g}) "
                                f"rotates {rotary} of each head's {cfg.head_dim} dims; the C++ decode stack rotates "
                                "whole heads"}
