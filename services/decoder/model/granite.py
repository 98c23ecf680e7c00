"""Granite 3 (model_type "granite"): Llama's layers with four multipliers (model/config.py reads them).

- the token embeddings are multiplied by embedding_multiplier;
- each block adds its attention and MLP outputs to the residual stream times residual_multiplier;
- attention_multiplier is the attention's softmax scale, in place of 1/sqrt(head_dim);
- the logits are the LM head's output divided by logits_scaling.
Everything else (RMSNorm, q/k/v/o and SiLU-gated MLP, RoPE) is Llama's, from model/layers.py, in the
order and dtype transformers' GraniteForCausalLM computes them.
"""
from __future__ import annotations

import torch
from torch import nn

from services.decoder.model.config import ModelConfig
from services.decoder.model.decoder import CausalLM
from services.decoder.model.layers import MLP, Attention, AttentionFn, RMSNorm


class GraniteLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)        # scaled by cfg.attention_scale (attention_multiplier)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        m = self.residual_multiplier
        # The residual add and the norm after it in one pass where native: the sum is x + attn * m, as
        # transformers adds it.
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attend)
        x, h = self.post_attention_layernorm.add_forward(x, attn * m)
        return x + self.mlp(h) * m


class Granite(CausalLM):
    Layer = GraniteLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.config.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Divided in the head's dtype, then widened, as transformers does.
        return (self.lm_head(hidden) / self.config.logits_scaling).float()

    def unsupported(self) -> dict[str, str]:
        out = {"decode_stack": "granite's embedding, residual and attention multipliers are not in the C++ "
                               "decode stack's layer"}
        if self.config.logits_scaling != 1.0:
            # The screen returns the argmax of the undivided head: two logits the division rounds to one
            # value would break the tie the other way.
            out["screen"] = "granite divides the logits by logits_scaling; the screen's argmax is of the head's"
        return out
