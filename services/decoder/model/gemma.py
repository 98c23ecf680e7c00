"""Gemma 2 (model_type "gemma2") and Gemma 3's text model ("gemma3_text"): sandwich-normed blocks with GeGLU.

Per layer, both normalise each block's input and its output before the residual add:
    x = x + post_attention_layernorm(attention(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
with Gemma's RMSNorm, which scales by (1 + weight), in fp32, before rounding to the activations' dtype. The
MLP gates with the tanh GELU (gelu_pytorch_tanh) instead of SiLU. The embeddings are multiplied by
sqrt(hidden_size) rounded to the activations' dtype, as transformers does. The attention scale is
query_pre_attn_scalar**-0.5 (model/config.py sets it as attention_scale); which layers slide over a window
of keys and the attention scores' soft-cap are ModelConfig.layer_windows and attn_softcap, applied by the
runner's attention (the AttentionFn), not here. The final logits are soft-capped: cap * tanh(logits / cap).

Gemma 3 adds a per-head q/k norm (Gemma's (1 + weight) form) before RoPE, and rotates its sliding-window
layers with their own RoPE (ModelConfig.local_rope, a lower base) and its global layers with `rope`;
transformers' Gemma 3 does not soft-cap attention scores (config.py refuses a config that asks it to).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.decoder.model.config import ModelConfig
from services.decoder.model.decoder import CausalLM
from services.decoder.model.layers import MLP, Attention, AttentionFn
from services.decoder.model.rotary import Rotary


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape: variance and the (1 + weight) product in fp32, then cast back."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GemmaMLP(MLP):
    activation = staticmethod(gelu_tanh)


class Gemma3Attention(Attention):
    """Llama's projections (scaled by cfg.attention_scale) with Gemma's per-head q/k norm before RoPE: the
    base forward normalises each head with q_norm / k_norm when they are set."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class Gemma2Layer(nn.Module):
    SelfAttention: type[Attention] = Attention

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.SelfAttention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sliding = bool(cfg.layer_windows) and cfg.layer_windows[layer] is not None   # a local layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attend))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Layer(Gemma2Layer):
    SelfAttention = Gemma3Attention


class Gemma2(CausalLM):
    Layer = Gemma2Layer
    Norm = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        # transformers multiplies by sqrt(hidden) as a tensor of the weight's dtype (8.0 stays 8.0; 48.0 too, but
        # sqrt(2000) rounds in bf16), so the same rounded factor here.
        scale = torch.tensor(self.config.hidden_size ** 0.5, device=weight.device).to(weight.dtype)
        return self.model.embed_tokens(input_ids) * scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden)
        cap = self.config.final_softcap
        if cap is not None:     # in the head's dtype, then widened, as transformers does
            out = torch.tanh(out / cap) * cap
        return out.float()

    def use_native_glue(self, norm: bool, act: bool) -> None:
        """Nothing to switch: Gemma's norms and GeGLU have no C++ row op (unsupported says so)."""

    def unsupported(self) -> dict[str, str]:
        family = self.config.family
        out = {"decode_stack": f"{family}'s sandwich norms, GeGLU, soft-caps and sliding windows are not the C++ "
                               "decode stack's layer",
               "glue.norm": f"{family}'s RMSNorm scales by 1 + weight, the C++ norm by the weight",
               "glue.act": f"{family}'s MLP gates with the tanh GELU, the C++ op with SiLU"}
        if self.config.final_softcap is not None:
            # tanh saturates: logits the head tells apart can cap to one value, whose tie the full head breaks
            # toward the first index, the screen toward the larger uncapped logit.
            out["screen"] = f"{family} soft-caps the logits (final_logit_softcapping); the screen's argmax is " \
                            "of the head's"
        return out


class Gemma3(Gemma2):
    Layer = Gemma3Layer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.local_rotary: Rotary | None = None     # setup_rotary, as `rotary`

    def setup_rotary(self, device: torch.device | str) -> None:
        super().setup_rotary(device)
        cfg = self.config
        self.local_rotary = Rotary(cfg.head_dim, cfg.local_rope or cfg.rope or cfg.rope_theta, device=device)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        """embeds [N, hidden], positions [N] -> final-normed hidden states [N, hidden]; the sliding-window
        layers rotate by the local RoPE, the others by the global one."""
        kinds = {layer.sliding for layer in self.model.layers}
        rotations = {local: (self.local_rotary if local else self.rotary).cos_sin(positions, embeds.dtype)
                     for local in kinds}
        x = embeds
        for layer in self.model.layers:
            x = layer(x, *rotations[layer.sliding], attend)
        return self.model.norm(x)
