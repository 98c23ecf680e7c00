"""The causal LM: embeddings, decoder layers, final norm, LM head (Llama / Qwen2 / Qwen3).

`CausalLM.model.*` and `CausalLM.lm_head` mirror transformers' names, so a checkpoint's
keys are our state_dict keys. The forward pass runs every token of a step at once:
one [N, hidden] matmul per projection per layer, whatever mix of requests the step has.

Another family subclasses CausalLM in its own module (model/granite.py, model/olmo2.py; the
registry is model/families.py): its layer and norm classes, its embedding and logits, and the
fast paths that do not compute its math (`unsupported`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from services.common import arena
from services.decoder.model.config import ModelConfig
from services.decoder.model.layers import MLP, AttentionFn, DecoderLayer, RMSNorm
from services.decoder.model.linear import Linear
from services.decoder.model.rotary import Rotary

# Engine features a family may decline in refused_features(), each refused at load with the family's
# reason: the bf16 dtype and int8 or int4 weights (runner/runner.py) and LoRA adapters (lora/bank.py). The rest
# (chunked prefill, prefix caching, preemption, n > 1, sampling, logprobs, structured outputs, speculative
# decoding) act on tokens, KV blocks and logits only, so every family whose forward the runner runs serves them.
DECLINABLE = ("bf16", "int8", "int4", "lora")


@dataclass(frozen=True)
class StoredPart:
    """Where a checkpoint tensor stored under another name goes: param[index] of our parameter `param`,
    which `parts` such tensors fill together (index () and parts 1: a whole tensor renamed)."""

    param: str
    index: tuple
    parts: int


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: type[nn.Module], norm: type[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama, Qwen2 and Qwen3 (and Qwen2-VL's text model)."""

    # A family's decoder layer (cfg, index) and final norm (width, eps); see model/families.py.
    Layer: type[nn.Module] = DecoderLayer
    Norm: type[nn.Module] = RMSNorm
    # A checkpoint projection that stores several of ours side by side in its rows (Phi-3's qkv_proj): its
    # name -> ours, in row order. The loader splits its weights and the adapter loader its lora_B rows.
    checkpoint_fused: dict[str, tuple[str, ...]] = {}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, self.Layer, self.Norm)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Plain object, not a buffer: it is not in checkpoints and must not be created on meta.
        self.rotary: Rotary | None = None
        self.arena: arena.Arena | None = None   # place_weights

    def fuse_projections(self) -> None:
        """Q/K/V and gate/up as one matmul each: per layer 4 matmuls instead of 7, so fewer calls at
        batch 1 and wider ones at 64 rows. The original modules stay, without their dense weights, so
        names, the adapter bank and LoRA corrections (Linear.correct) keep working per projection."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @torch.no_grad()
    def place_weights(self, huge_pages: bool = True) -> str:
        """Move every weight a step reads (dense, int8 and scales; a tied one once) into one arena of
        huge pages (services/common/arena.py; huge_pages=False keeps them where they are); returns its
        summary for the log."""
        params = [p for p in self.parameters() if p.numel()]
        quantized = [m for m in self.modules() if isinstance(m, Linear) and m.qweight is not None]
        grouped = [m for m in self.modules() if isinstance(m, Linear) and m.grouped is not None]
        tensors = [p.data for p in params] + [t for m in quantized for t in (m.qweight, m.qscale)] + \
            [t for m in grouped for t in (m.grouped.codes, m.grouped.scale, m.grouped.offset)]
        self.arena, views, summary = arena.place(tensors, huge_pages)
        n, q = len(params), len(params) + 2 * len(quantized)
        for p, v in zip(params, views[:n], strict=True):
            p.data = v
        for m, qw, s in zip(quantized, views[n:q:2], views[n + 1:q:2], strict=True):
            m.qweight, m.qscale = qw, s
        for i, m in enumerate(grouped):
            codes, scale, offset = views[q + 3 * i:q + 3 * i + 3]
            m.grouped = dataclasses.replace(m.grouped, codes=codes, scale=scale, offset=offset)
        return summary

    def use_native_glue(self, norm: bool, act: bool) -> None:
        """Run the RMSNorms and SiLU(gate) * up by the C++ row ops (model/glue.py decides by timing)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.native = norm
            elif isinstance(m, MLP):
                m.native = act

    def unsupported(self) -> dict[str, str]:
        """Fast path (a --fast-paths name, or glue.norm / glue.act) -> why it does not compute this family's
        math, for each that does not: those run the reference path and the plan says why. Llama's layer is
        what every fast path computes, so none here."""
        return {}

    def refused_features(self) -> dict[str, str]:
        """Engine feature (DECLINABLE) -> why this family does not serve it, for each it declines; the
        runner and the adapter bank refuse it at load with that reason. Every family served declines none."""
        return {}

    def stored_part(self, name: str) -> StoredPart | None:
        """A checkpoint key that is not one of our parameter names -> where its tensor goes; None: the key
        is our parameter's own name (every family whose checkpoint names are transformers' module names)."""
        return None

    def setup_rotary(self, device: torch.device | str) -> None:
        cfg = self.config
        self.rotary = Rotary(cfg.head_dim, cfg.rope or cfg.rope_theta, cfg.mrope_sections, device=device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> embeddings [N, hidden] (the runner may replace image rows)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        """embeds [N, hidden], positions [N] or [3, N] -> final-normed hidden states [N, hidden]."""
        cos, sin = self.rotary.cos_sin(positions, embeds.dtype)
        x = embeds
        for layer in self.model.layers:
            x = layer(x, cos, sin, attend)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] (only the rows that are sampled) -> fp32 logits [M, vocab]."""
        return self.lm_head(hidden).float()
