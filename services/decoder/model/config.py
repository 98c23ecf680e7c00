"""The decoder checkpoint's config.json (and generation_config.json), read and validated.

We implement exactly: Llama, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), Granite
(embedding, residual, attention and logit multipliers) and OLMo 2 (post-norm blocks, q/k
RMSNorm over the whole projection) decoders with SiLU-gated MLPs, full causal attention and
unscaled RoPE (optionally M-RoPE sections). Each family's module is named in
model/families.py. Anything else a config asks for is refused with Unsupported at load,
because silently ignoring e.g. a RoPE scaling recipe would compute a different model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument, Unsupported

FAMILIES = ("llama", "qwen2", "qwen3", "granite", "olmo2")
# Vision-language checkpoints whose text model is one of FAMILIES: model_type -> text family.
# The decoder loads only the text model; the vision service loads the tower from the same folder.
VISION_LANGUAGE = {"qwen2_vl": "qwen2"}


@dataclass(frozen=True)
class VisionTokens:
    """A vision-language checkpoint's image-token ids (config.json) and vision merge size.

    image_token_id is the placeholder the chat template writes once per image and the prompt
    builder expands to t*h*w rows (the post-merge grid); vision_start/end frame it.
    """

    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    spatial_merge_size: int


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
    qk_norm: bool                         # Qwen3's per-head q/k RMSNorm (OLMo 2's are model/olmo2.py's)
    # Granite's multipliers (model/granite.py); every other family keeps these identities.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # softmax(scale * q.k); None: 1/sqrt(head_dim)
    logits_scaling: float = 1.0           # the logits are the head's output divided by this
    mrope_sections: tuple[int, int, int] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    vision: VisionTokens | None = None    # set for vision-language checkpoints (images accepted)

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
        vision = None
        if raw.get("model_type") in VISION_LANGUAGE:
            raw, vision = _text_of_vision_language(raw)
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
        # Qwen2 always has q/k/v bias and never o bias; the other families use attention_bias for all four.
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
            mlp_bias=bool(raw.get("mlp_bias", False)) if family in ("llama", "granite") else False,
            qk_norm=family == "qwen3",
            **(_granite_multipliers(raw) if family == "granite" else {}),
            mrope_sections=sections,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            vision=vision,
        )


def _text_of_vision_language(raw: dict) -> tuple[dict, VisionTokens]:
    """A Qwen2-VL config.json -> (a flat text-model config in FAMILIES' terms, its image tokens).

    transformers 5 writes the text model under "text_config" (model_type "qwen2_vl_text") and keeps the
    image-token ids and tie_word_embeddings at the top; transformers 4 wrote one flat dict (with
    rope_scaling {"type": "mrope", ...}). Both become the same flat dict: top-level keys first, then
    text_config's over them, except tie_word_embeddings, which transformers reads from the top.
    """
    kind = raw["model_type"]
    text = raw.get("text_config")
    flat = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    if isinstance(text, dict):
        flat.update(text)
        if "tie_word_embeddings" in raw:
            flat["tie_word_embeddings"] = raw["tie_word_embeddings"]
    flat["model_type"] = VISION_LANGUAGE[kind]
    if _rope(flat)[1] is None:
        # Without sections an image's [3, T] positions could not be applied; refuse at load, not per request.
        raise InvalidArgument(f"{kind} config has no rope mrope_section")
    image = raw.get("image_token_id", flat.get("image_token_id"))
    if not isinstance(image, int) or isinstance(image, bool):
        raise InvalidArgument(f"{kind} config has no integer image_token_id")
    merge = int((raw.get("vision_config") or {}).get("spatial_merge_size", 2))

    def _id(name: str) -> int | None:
        value = raw.get(name, flat.get(name))
        return None if value is None else int(value)

    return flat, VisionTokens(image_token_id=image, video_token_id=_id("video_token_id"),
                              vision_start_token_id=_id("vision_start_token_id"),
                              vision_end_token_id=_id("vision_end_token_id"), spatial_merge_size=merge)


def _granite_multipliers(raw: dict) -> dict:
    """Granite's four multipliers (transformers' defaults 1.0), as ModelConfig fields. Its
    attention_multiplier replaces 1/sqrt(head_dim) as the attention scale."""
    values = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        value = raw.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InvalidArgument(f"granite config key {key} must be a positive number, got {value!r}")
        values[key] = float(value)
    return dict(embedding_multiplier=values["embedding_multiplier"],
                residual_multiplier=values["residual_multiplier"],
                attention_scale=values["attention_multiplier"], logits_scaling=values["logits_scaling"])


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
