"""The decoder checkpoint's config.json (and generation_config.json), read and validated.

We implement exactly: Llama, Mistral (Llama's layer), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm),
Granite (embedding, residual, attention and logit multipliers) and OLMo 2 (post-norm blocks, q/k RMSNorm
over the whole projection) decoders with SiLU-gated MLPs, Qwen3-MoE, Qwen2-MoE and Mixtral with
mixtures of SiLU-gated experts (model/moe_config.py), causal attention (per layer over the whole
context or a sliding window, `layer_windows`) and RoPE under transformers' recipes (model/rope.py;
unscaled RoPE optionally with M-RoPE sections); and Gemma 2 / Gemma 3 text (model/gemma.py: GeGLU,
sandwich norms, soft-caps). Each family's module is named in model/families.py.
Anything else a config asks for is refused with Unsupported at load, in one line naming the config key,
because silently ignoring it would compute a different model.

Phi-3 / Phi-4-mini (model/phi3.py) are Llama's layer over fused checkpoint projections; phi3 alone takes
partial_rotary_factor (model/rotary.py rotates the first part of each head).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.model import moe_config
from services.decoder.model import rope as rope_recipes
from services.decoder.model.moe_config import MoeConfig
from services.decoder.model.rope import RopeScaling

FAMILIES = ("llama", "qwen2", "qwen3", "granite", "olmo2", "phi3", "mistral", "gemma2", "gemma3_text") + \
    moe_config.FAMILIES
GEMMA = ("gemma2", "gemma3_text")
# Vision-language checkpoints whose text model is one of FAMILIES: model_type -> text family.
# The decoder loads only the text model; the vision service loads the tower from the same folder.
# Qwen2.5-VL's text model and its M-RoPE positions for images are Qwen2-VL's (its tower differs).
VISION_LANGUAGE = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2"}


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
    rope: RopeScaling | None = None       # the RoPE recipe (model/rope.py); None: unscaled at rope_theta
    # Per layer, the sliding window in keys (a query at position p sees keys p - w + 1 .. p, as transformers'
    # sliding mask), or None for full attention; () when every layer attends to its whole context.
    layer_windows: tuple[int | None, ...] = ()
    attn_softcap: float | None = None     # scores become softcap * tanh(scores / softcap) (Gemma 2)
    final_softcap: float | None = None    # logits become cap * tanh(logits / cap) (Gemma 2, optionally Gemma 3)
    local_rope: RopeScaling | None = None  # RoPE of the sliding-window layers (Gemma 3); None: `rope`
    moe: MoeConfig | None = None          # the experts of a mixture-of-experts family (model/moe_config.py)

    @staticmethod
    def from_folder(folder: str | Path) -> ModelConfig:
        folder = Path(folder)
        path = folder / "config.json"
        if not path.is_file():
            raise InvalidArgument(f"{folder} has no config.json")
        raw = _json(path)
        gen_path = folder / "generation_config.json"
        gen = _json(gen_path) if gen_path.is_file() else {}
        return ModelConfig.from_dict(raw, gen)

    @staticmethod
    def from_dict(raw: dict, generation: dict | None = None) -> ModelConfig:
        try:
            return ModelConfig._from_dict(raw, generation)
        except KeyError as exc:     # a key every family needs: say which, in one line
            raise InvalidArgument(f"config.json has no {exc.args[0]!r}") from None

    @staticmethod
    def _from_dict(raw: dict, generation: dict | None) -> ModelConfig:
        vision = None
        if raw.get("model_type") in VISION_LANGUAGE:
            raw, vision = _text_of_vision_language(raw)
        family = raw.get("model_type")
        if family not in FAMILIES:
            raise Unsupported(f"config.json model_type {family!r} is not supported "
                              f"(supported: {', '.join(FAMILIES + tuple(VISION_LANGUAGE))})")
        if family in GEMMA:
            raw = _gemma_defaults(raw)
        else:
            act = raw.get("hidden_act", "silu")
            if act != "silu":
                raise Unsupported(f"config.json hidden_act {act!r} is not supported (only silu)")
        num_layers = int(raw["num_hidden_layers"])
        windows = layer_windows(raw, family, num_layers)
        if family == "phi3":     # Phi3Config's default, which its longrope reads when config.json omits it
            raw = {"original_max_position_embeddings": 4096, **raw}
        rope, sections = (_gemma3_ropes(raw)[0], None) if family == "gemma3_text" else rope_recipes.parse(raw)
        if sections is not None and family in GEMMA:
            raise Unsupported(f"{family} config key rope_parameters.mrope_section is not supported")
        if rope.partial_rotary_factor != 1.0 and family != "phi3":
            raise Unsupported(f"config.json partial_rotary_factor {rope.partial_rotary_factor:g} is not supported for "
                              f"model_type {family!r} (its layers rotate whole heads)")
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise InvalidArgument(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
        rope_recipes.check_dims(rope, head_dim)
        if sections is not None and 2 * sum(sections) != head_dim:
            raise InvalidArgument(f"mrope_section {sections} must total head_dim/2 = {head_dim // 2} pairs")
        attention_bias = bool(raw.get("attention_bias", False)) and family != "phi3"   # Phi-3 has no biases
        # Qwen2 always has q/k/v bias and never o bias; the other families use attention_bias for all four.
        qkv_bias = True if family == "qwen2" else attention_bias
        o_bias = False if family == "qwen2" else attention_bias
        if family == "qwen2_moe":           # Qwen2-MoE names its q/k/v bias qkv_bias (default on), never o's
            qkv_bias, o_bias = bool(raw.get("qkv_bias", True)), False
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        return ModelConfig(
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if family in ("llama", "granite") else False,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            **(_granite_multipliers(raw) if family == "granite" else {}),
            **(_gemma_fields(raw) if family in GEMMA else {}),
            mrope_sections=sections,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            vision=vision,
            rope=rope,
            moe=moe_config.parse(raw, family) if family in moe_config.FAMILIES else None,
            layer_windows=windows,
        )


def _text_of_vision_language(raw: dict) -> tuple[dict, VisionTokens]:
    """A Qwen2-VL or Qwen2.5-VL config.json -> (a flat text-model config in FAMILIES' terms, its image tokens).

    transformers 5 writes the text model under "text_config" (model_type "qwen2_vl_text" or "qwen2_5_vl_text")
    and keeps the image-token ids and tie_word_embeddings at the top; transformers 4 wrote one flat dict (with
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
    if rope_recipes.parse(flat)[1] is None:
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


def _json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise InvalidArgument(f"{path.name} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{path.name} is not a JSON object")
    return raw


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


# Families whose transformers class never slides: a sliding layer_types there is refused, not guessed at.
_FULL_ONLY = ("llama", "granite", "olmo2")


def layer_windows(raw: dict, family: str, num_layers: int) -> tuple[int | None, ...]:
    """config.json -> ModelConfig.layer_windows, as transformers 5 reads each family's keys.

    Mistral and Phi-3: `sliding_window` on every layer (null: full), `layer_types` ignored as their classes
    ignore it.
    Qwen2/Qwen3: `sliding_window` only with `use_sliding_window`; `layer_types` when written,
    else layers from `max_window_layers` on slide. Any other family: `layer_types` (sliding_attention/full_attention)
    with `sliding_window`. A window w means a query at position p sees keys p - w + 1 .. p (transformers'
    sliding_window_overlay: kv_idx > q_idx - w). () when every layer attends to its whole context.
    """
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window"):
        window = None
    if family in ("mistral", "phi3"):
        types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    else:
        types = raw.get("layer_types")
        if types is None and family in ("qwen2", "qwen3"):
            first = int(raw.get("max_window_layers", num_layers))
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(num_layers)]
        types = types or ["full_attention"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        raise InvalidArgument(f"config.json layer_types must list one type per layer ({num_layers})")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise Unsupported(f"config.json layer_types {unknown} are not supported "
                          "(only full_attention, sliding_attention)")
    if "sliding_attention" not in types:
        return ()
    if family in _FULL_ONLY:
        raise Unsupported(f"config.json layer_types sliding_attention is not supported for {family} "
                          "(its transformers class attends to the whole context)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidArgument(f"config.json sliding_window must be a positive integer for sliding_attention "
                              f"layers, got {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


# transformers' Gemma2Config / Gemma3TextConfig defaults for the keys their math reads: a config.json
# without one of these computes with the default there, so here too.
_GEMMA_DEFAULTS = {
    "gemma2": dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   tie_word_embeddings=True, max_position_embeddings=8192),
    "gemma3_text": dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                        sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
                        tie_word_embeddings=True, max_position_embeddings=131072),
}
_GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma_defaults(raw: dict) -> dict:
    """A Gemma config.json with transformers' defaults filled in (layer_types too: older configs have none,
    Gemma 2 alternates from a local layer, Gemma 3 repeats sliding_window_pattern), its activation checked:
    GeGLU with the tanh GELU, which transformers reads from hidden_activation (hidden_act, where an older
    config also has it, must agree)."""
    raw = {**_GEMMA_DEFAULTS[raw["model_type"]], **raw}
    if raw.get("layer_types") is None:
        pattern = 2 if raw["model_type"] == "gemma2" else int(raw.get("sliding_window_pattern", 6))
        raw["layer_types"] = [_GEMMA_LAYER_TYPES[(i + 1) % pattern == 0] for i in range(int(raw["num_hidden_layers"]))]
    for key in ("hidden_activation", "hidden_act"):
        act = raw.get(key, "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise Unsupported(f"{raw['model_type']} config key {key} {act!r} is not supported (only gelu_pytorch_tanh)")
    return raw


def _positive(raw: dict, key: str, *, optional: bool = False) -> float | None:
    value = raw.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgument(f"{raw['model_type']} config key {key} must be a positive number, got {value!r}")
    return float(value)


def _gemma_fields(raw: dict) -> dict:
    """Gemma 2 / Gemma 3 text as ModelConfig fields: the attention scale query_pre_attn_scalar**-0.5 and the
    soft-caps (Gemma 3 also the local layers' RoPE); their windows are layer_windows'."""
    family = raw["model_type"]
    if raw.get("use_bidirectional_attention"):
        raise Unsupported(f"{family} config key use_bidirectional_attention is not supported (causal only)")
    if family == "gemma3_text" and raw.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 reads the key but never applies it: refused rather than guessed.
        raise Unsupported("gemma3_text config key attn_logit_softcapping is not supported "
                          "(transformers' Gemma 3 does not apply it)")
    return dict(attention_scale=_positive(raw, "query_pre_attn_scalar") ** -0.5,
                attn_softcap=_positive(raw, "attn_logit_softcapping", optional=True),
                final_softcap=_positive(raw, "final_logit_softcapping", optional=True),
                local_rope=_gemma3_ropes(raw)[1] if family == "gemma3_text" else None)


def _gemma3_ropes(raw: dict) -> tuple[RopeScaling, RopeScaling]:
    """Gemma 3's (global, local) RoPE: transformers 5 nests rope_parameters by layer type; older configs give
    rope_theta and rope_scaling for the global layers and rope_local_base_freq for the local ones."""
    nested = raw.get("rope_parameters")
    if nested is None:
        nested = {"full_attention": dict(raw.get("rope_scaling") or {}, rope_theta=raw.get("rope_theta", 1e6)),
                  "sliding_attention": {"rope_theta": raw.get("rope_local_base_freq", 1e4)}}
    if not isinstance(nested, dict) or not set(nested) <= set(_GEMMA_LAYER_TYPES):
        raise Unsupported("gemma3_text config key rope_parameters must be nested by layer type "
                          f"({', '.join(_GEMMA_LAYER_TYPES)})")
    ropes = []
    for kind, theta in (("full_attention", raw.get("rope_theta", 1e6)),
                        ("sliding_attention", raw.get("rope_local_base_freq", 1e4))):
        params = dict(nested.get(kind) or {})
        params.setdefault("rope_theta", theta)
        rope, _ = rope_recipes.parse({"rope_parameters": params,
                                      "max_position_embeddings": raw["max_position_embeddings"]})
        if rope.kind not in ("default", "linear"):
            raise Unsupported(f"gemma3_text config key rope_parameters.{kind}.rope_type {rope.kind!r} is not "
                              "supported (only default, linear)")
        ropes.append(rope)
    return ropes[0], ropes[1]
