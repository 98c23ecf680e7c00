"""Qwen3-MoE, Qwen2-MoE and Mixtral (model_type "qwen3_moe", "qwen2_moe", "mixtral"): Llama's layer with
a mixture of experts in place of its MLP.

Each layer is Llama's (model/layers.py: RMSNorm, attention, the residual adds); the attention is Qwen3's
for Qwen3-MoE (per-head q/k RMSNorm), Qwen2's for Qwen2-MoE (q/k/v biases, `qkv_bias`) and Llama's for
Mixtral (model/config.py reads which). Its MLP is a SparseMoeBlock where model/moe_config.py says the layer
is sparse, else Llama's dense MLP (Qwen's `mlp_only_layers` / `decoder_sparse_step`). The block:
    routing = router(x)                          (model/moe.py: softmax, top-k, the family's weights)
    out = experts(x, routing)                    (only the chosen experts' weights are read)
    out += sigmoid(shared_expert_gate(x)) * shared_expert(x)       (Qwen2-MoE only)

Checkpoints: transformers 5's save_pretrained writes each expert's projections apart,
`mlp.experts.{e}.{gate,up,down}_proj.weight` (Mixtral: `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` and
`block_sparse_moe.gate.weight`); its in-memory layout, stacked `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I], is ours, so a checkpoint that stores those loads as it is and the per-
expert keys are copied into their slices at load (`stored_part`).
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from services.decoder.model.config import ModelConfig
from services.decoder.model.decoder import CausalLM, StoredPart
from services.decoder.model.layers import MLP, DecoderLayer
from services.decoder.model.linear import Linear
from services.decoder.model.moe import Experts, Router


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.gate = Router(cfg.hidden_size, moe)
        self.experts = Experts(cfg.hidden_size, moe)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(dataclasses.replace(cfg, intermediate_size=moe.shared_expert_size, mlp_bias=False))
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def fuse(self) -> None:
        """The shared expert's gate|up as one matmul (CausalLM.fuse_projections); the experts are stacked."""
        if self.shared_expert is not None:
            self.shared_expert.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        if cfg.moe.sparse_layers[layer]:
            self.mlp = SparseMoeBlock(cfg)


# A checkpoint's per-expert key: (layer prefix, expert, projection).
_PER_EXPERT = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MoeCausalLM(CausalLM):
    Layer = MoeLayer

    def unsupported(self) -> dict[str, str]:
        return {"decode_stack": f"{self.config.family}'s mixture-of-experts layers are not the C++ decode stack's "
                                "dense MLP"}

    def use_native_glue(self, norm: bool, act: bool) -> None:
        super().use_native_glue(norm, act)
        for m in self.modules():
            if isinstance(m, Experts):
                m.native = act

    def stored_part(self, name: str) -> StoredPart | None:
        if ".block_sparse_moe.gate." in name:          # Mixtral's router, under our (transformers 5's) name
            return StoredPart(name.replace(".block_sparse_moe.", ".mlp."), (), 1)
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            return None
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        proj = _MIXTRAL.get(proj, proj)
        size, count = self.config.moe.expert_size, self.config.moe.num_experts
        if proj == "down_proj":
            return StoredPart(f"{prefix}.mlp.experts.down_proj", (expert,), count)
        rows = {"gate_proj": slice(0, size), "up_proj": slice(size, 2 * size)}.get(proj)
        if rows is None:
            return None
        return StoredPart(f"{prefix}.mlp.experts.gate_up_proj", (expert, rows), 2 * count)
