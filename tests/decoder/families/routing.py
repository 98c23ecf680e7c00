"""Routing pinned to transformers' for the mixture-of-experts families in bf16 and int8 tests.

Rounding may swap two experts whose probabilities lie a few steps apart: a discontinuity, not an error. These
tests make each of our routers pick the experts transformers' fp32 model picks (weighed by our own rule), so
the rest of the path can be held to the dtype's bound.
"""
from __future__ import annotations

import torch

from services.decoder.model.moe import Routing
from services.decoder.model.moe_decoder import SparseMoeBlock


def force_routing(model, experts: list[torch.Tensor]) -> None:
    """Make each sparse layer's router pick experts[layer][row] for its next rows (in the order the rows
    come, chunk after chunk), with the weights its own rule gives them from its own probabilities."""
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    for router, ids in zip((b.gate for b in blocks), experts, strict=True):
        served = [0]

        def forward(x, router=router, ids=ids, served=served):
            logits = torch.nn.functional.linear(x, router.weight)
            chosen = ids[served[0]:served[0] + x.shape[0]]
            served[0] += x.shape[0]
            top = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, chosen)
            if router.norm_topk:
                top = top / top.sum(dim=-1, keepdim=True)
            return Routing(chosen, top if router.weights_fp32 else top.to(logits.dtype))
        router.forward = forward


def reference_routing(ref, tokens: list[int]) -> list[torch.Tensor]:
    """Each sparse layer's chosen experts [N, top_k] in transformers' model for the sequence tokens."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append(out[2]))
             for m in ref.modules() if type(m).__name__.endswith("TopKRouter")]
    with torch.no_grad():
        ref(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return seen
