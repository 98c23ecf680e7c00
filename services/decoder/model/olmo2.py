"""OLMo 2 (model_type "olmo2"): post-norm blocks and q/k RMSNorm over the whole projection.

Per layer, where Llama normalises each block's input, OLMo 2 normalises its output before the
residual add:
    x = x + post_attention_layernorm(attention(x))
    x = x + post_feedforward_layernorm(mlp(x))
and its attention normalises q and k over all heads at once (q_norm is [heads * head_dim] wide, k_norm
[kv_heads * head_dim]) before splitting them into heads and rotating them. The projections, the
SiLU-gated MLP and RoPE are Llama's (model/layers.py). Its RMSNorm multiplies by the weight before
rounding to the activations' dtype (Llama rounds first): the same in fp32, one rounding apart in bf16.
"""
from __future__ import annotations

import torch
from torch import nn

from services.decoder.model.config import ModelConfig
from services.decoder.model.decoder import CausalLM
from services.decoder.model.layers import MLP, Attention, AttentionFn
from services.decoder.model.rotary import apply_rotary


class Olmo2RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape: variance and the weight's product in fp32, then cast back."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.q_norm = Olmo2RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        n, d = x.shape[0], self.head_dim
        q, k, v, _ = self.project(x)
        q = apply_rotary(self.q_norm(q).view(n, self.num_heads, d), cos, sin)
        k = apply_rotary(self.k_norm(k).view(n, self.num_kv_heads, d), cos, sin)
        return self.attend(attend, q, k, v.view(n, self.num_kv_heads, d))


class Olmo2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, attend))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2(CausalLM):
    Layer = Olmo2Layer
    Norm = Olmo2RMSNorm

    def unsupported(self) -> dict[str, str]:
        return {"decode_stack": "olmo2's post-norm blocks and whole-projection q/k norms are not the C++ decode "
                                "stack's layer",
                "glue.norm": "olmo2's RMSNorm rounds after its weight, the C++ norm before it"}
