"""The decoder checkpoint's config.json (and generation_config.json), read and validated.

We implement exactly: Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm) decoders with
SiLU-gated MLPs, full causal attention and unscaled RoPE (optionally M-RoPE sections).
Anything else a config asks for is refused with Unsupported at load, because silently
ignoring e.g. a RoPE scaling recipe would compute a different model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument, Unsupported

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    mrope_sections: tuple[int, int, int] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @staticmethod
    def from_folder(folder: str | Path) -> ModelConfig:
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise InvalidArgument(f"{folder} has no config.json")
        raw = json.loads(path.read_text())
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return ModelConfig.from_dict(raw, gen)

    @staticmethod
    def from_dict(raw: dict, generation: dict | None = None) -> ModelConfig:
        family = raw.get("model_type")
        if family not in FAMILIES:
            raise Unsupported(f"model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise Unsupported(f"hidden_act {act!r} is not supported (only silu)")
        _refuse_sliding_window(raw)
        theta, sections = _rope(raw)
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise InvalidArgument(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        if sections is not None and 2 * sum(sections) != head_dim:
            raise InvalidArgument(f"mrope_section {sections} must total head_dim/2 = {head_dim // 2} pairs")
        attention_bias = bool(raw.get("attention_bias", False))
        # Qwen2 always has q/k/v bias and never o bias; Llama/Qwen3 use attention_bias for all four.
        qkv_bias = True if family == "qwen2" else attention_bias
        o_bias = False if family == "qwen2" else attention_bias
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        return ModelConfig(
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family == "qwen3",
            mrope_sections=sections,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )


def _refuse_sliding_window(raw: dict) -> None:
    if raw.get("use_sliding_window"):
        raise Unsupported("sliding-window attention (use_sliding_window) is not supported")
    kinds = set(raw.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise Unsupported(f"layer_types {sorted(kinds)} are not supported (only full_attention)")


def _rope(raw: dict) -> tuple[float, tuple[int, int, int] | None]:
    """(theta, M-RoPE sections) from transformers 5's rope_parameters, or the legacy keys.

    Only the unscaled ("default") recipe is implemented; every scaling recipe and every
    parameter we would not apply is refused instead of being dropped.
    """
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind not in ("default", "mrope"):
        raise Unsupported(f"RoPE scaling {kind!r} is not supported (only unscaled RoPE / M-RoPE)")
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    sections = params.pop("mrope_section", None)
    if params.pop("partial_rotary_factor", 1.0) != 1.0 or raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise Unsupported("partial_rotary_factor != 1 is not supported")
    if params.pop("mrope_interleaved", False):
        raise Unsupported("interleaved M-RoPE is not supported")
    if params:
        raise Unsupported(f"RoPE parameters {sorted(params)} are not supported by unscaled RoPE")
    if sections is not None:
        if len(sections) != 3 or min(sections) < 0:
            raise InvalidArgument(f"mrope_section must be three non-negative pair counts, got {sections}")
        sections = tuple(int(s) for s in sections)
    return float(theta), sections
