"""Decoder blocks over a flat batch of N tokens (no padding, no batch dimension).

Module and parameter names equal transformers' so checkpoint keys map one to one, and so
the adapter bank can later wrap q/k/v/o/gate/up/down_proj by name. Attention over the KV
cache is not done here: each layer hands q/k/v to an `attend` callable the runner owns
(see AttentionFn), which keeps the model free of cache layout and batching policy.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.decoder.kernels import glue_cpu
from services.decoder.model.config import ModelConfig
from services.decoder.model.linear import Linear, fuse, fusible
from services.decoder.model.rotary import apply_rotary


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None = None) -> torch.Tensor:
        """q [N, H, D], k/v [N, KVH, D] of this step's tokens -> attention output [N, H, D]; softmax of
        scale * q.k, scale 1/sqrt(D) when None. Layers pass scale only when their family sets one (Granite's
        attention_multiplier), so an AttentionFn that cannot apply a scale fails loudly for such a family."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.native = False       # the C++ row op (kernels/glue_cpu) on [N, dim] rows; set by model/glue.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape; variance in fp32, then cast back as transformers does."""
        if self.native and x.dim() == 2:
            return glue_cpu.rms_norm(x.contiguous(), self.weight, self.eps)[1]
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y [N, dim] -> (x + y, forward(x + y)), in one pass when native."""
        if self.native:
            return glue_cpu.rms_norm(x.contiguous(), self.weight, self.eps, y.contiguous())
        s = x + y
        return s, self(s)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_width, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, kv_width, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, kv_width, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_width, cfg.hidden_size, bias=cfg.o_bias)
        self.widths = (q_width, kv_width, kv_width)
        self.qkv: Linear | None = None        # q|k|v side by side, once fuse() ran
        self.scale = cfg.attention_scale      # None: the attend's 1/sqrt(head_dim)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def fuse(self) -> None:
        """Q, K and V as one matmul from now on (see CausalLM.fuse_projections)."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv = fuse(parts) if fusible(parts) else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [N, hidden] -> q [N, H*D], k, v [N, KVH*D] (adapter corrections applied), and q|k as one
        [N, (H+KVH)*D] view of the fused matmul's output when q and k are its slices still (no adapter, or
        corrections made in place, as the CPU pool's are), else None."""
        if self.qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x), None
        qkv = self.qkv(x)
        q0, k0, v = qkv.split(self.widths, dim=1)
        q, k, v = self.q_proj.correct(x, q0), self.k_proj.correct(x, k0), self.v_proj.correct(x, v)
        joint = qkv[:, :self.widths[0] + self.widths[1]] if q is q0 and k is k0 else None
        return q, k, v, joint

    def attend(self, attend: AttentionFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rotated q [N, H, D], k/v [N, KVH, D] -> o_proj of their attention [N, hidden]."""
        out = attend(self.layer, q, k, v) if self.scale is None else attend(self.layer, q, k, v, scale=self.scale)
        return self.o_proj(out.reshape(q.shape[0], self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        n, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v, joint = self.project(x)
        v = v.view(n, kv_heads, d)
        if joint is not None and self.q_norm is None:
            # q and k still lie side by side in qkv (no per-head norm, no adapter): rotate both at once.
            qk = apply_rotary(joint.view(n, heads + kv_heads, d), cos, sin)
            q, k = qk.split((heads, kv_heads), dim=1)
        else:
            q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
            if self.q_norm is not None:      # Qwen3 normalises each head before rotary
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.attend(attend, q, k, v)


class MLP(nn.Module):
    # The gate's activation on the torch path; a family with another (Gemma's GeGLU) sets its own and declares
    # glue.act unsupported, since the C++ row op computes SiLU only.
    activation = staticmethod(F.silu)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up: Linear | None = None    # gate|up side by side, once fuse() ran
        self.native = False       # SiLU(gate) * up by the C++ row op (kernels/glue_cpu); set by model/glue.py

    def fuse(self) -> None:
        parts = [self.gate_proj, self.up_proj]
        self.gate_up = fuse(parts) if fusible(parts) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=1)
            gate, up = self.gate_proj.correct(x, gate), self.up_proj.correct(x, up)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # Whether or not adapters changed them, the same op: base rows of a mixed-adapter step stay
        # bit-equal to the step without adapters.
        if self.native:
            return self.down_proj(glue_cpu.silu_mul(gate, up))
        return self.down_proj(self.activation(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), cos, sin, attend))
        return x + self.mlp(h)
