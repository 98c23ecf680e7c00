"""A mixture-of-experts checkpoint's config.json keys (Qwen3-MoE, Qwen2-MoE, Mixtral), read and validated.

Which layers are sparse follows transformers' Qwen MoE rule: layer i has experts unless i is in
`mlp_only_layers`, and then only when num_experts > 0 and (i + 1) % decoder_sparse_step == 0; every other
layer is a dense SiLU-gated MLP of `intermediate_size`. Mixtral's layers are all sparse, its experts
`intermediate_size` wide. What a routed token's weights are differs by family (model/moe.py, `route`):
Qwen divides the top-k probabilities by their sum only under `norm_topk_prob` and rounds them to the
activations' dtype; Mixtral always divides and keeps them fp32 until they multiply the expert's output.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import InvalidArgument, Unsupported

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int                            # experts per token (num_experts_per_tok)
    expert_size: int                      # each expert's intermediate width
    norm_topk: bool                       # divide the top-k probabilities by their sum
    weights_fp32: bool                    # Mixtral: routing weights stay fp32 (Qwen: rounded to the activations')
    sparse_layers: tuple[bool, ...]       # per layer: experts (True) or the dense MLP
    shared_expert_size: int = 0           # Qwen2-MoE: the sigmoid-gated shared expert's width (0: none)


def _count(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"config.json {key} must be a positive integer, got {value!r}")
    return value


def parse(raw: dict, family: str) -> MoeConfig:
    """config.json of a FAMILIES model -> its MoeConfig (num_experts under either of its names)."""
    layers = int(raw["num_hidden_layers"])
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (an attribute alias); Qwen's own
    # checkpoints say num_experts.
    key = "num_experts" if "num_experts" in raw else "num_local_experts"
    experts = _count(key, raw.get(key))
    top_k = _count("num_experts_per_tok", raw.get("num_experts_per_tok", 2))
    if top_k > experts:
        raise InvalidArgument(f"config.json num_experts_per_tok {top_k} exceeds {key} {experts}")
    if raw.get("use_sliding_window"):
        raise Unsupported(f"config.json use_sliding_window (sliding-window attention) is not supported for {family}")
    if family == "mixtral":
        if raw.get("sliding_window") is not None:
            raise Unsupported("config.json sliding_window (Mixtral's sliding-window attention) is not supported")
        return MoeConfig(experts, top_k, _count("intermediate_size", raw["intermediate_size"]),
                         norm_topk=True, weights_fp32=True, sparse_layers=(True,) * layers)
    step = _count("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise InvalidArgument(f"config.json mlp_only_layers must be a list of layer indices, got {dense!r}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    shared = 0
    if family == "qwen2_moe":
        shared = _count("shared_expert_intermediate_size", raw.get("shared_expert_intermediate_size"))
    return MoeConfig(experts, top_k, _count("moe_intermediate_size", raw.get("moe_intermediate_size")),
                     norm_topk=bool(raw.get("norm_topk_prob", False)), weights_fp32=False,
                     sparse_layers=sparse, shared_expert_size=shared)
