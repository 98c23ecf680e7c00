"""RoPE recipes: a checkpoint's rotary frequencies (and attention factor) from its config.json.

Each recipe repeats transformers' own init function (modeling_rope_utils.py, 5.24) op for op, in the same
dtypes and the same order, so the fp32 frequencies equal the reference's bit for bit: `default` (unscaled),
`linear`, `dynamic` (NTK), `yarn` (with its attention factor on cos and sin), `longrope` (short/long factors
and its attention factor) and `llama3` (frequency bands). Anything else is refused at load.

Two recipes depend on the sequence length, which transformers reads per forward from the forward's largest
position: `dynamic` recomputes the NTK base for it, `longrope` switches from short to long factors once it
passes original_max_position_embeddings. A paged KV cache keeps each key as it was rotated when it was
computed, and the same token may be computed in another chunk after preemption or come from the prefix
cache, so here a token's frequencies depend on its own position only (its KV is then a function of its
tokens and positions, which is what the prefix-cache hash covers, docs/design.md invariant 4):

- dynamic: the token at position p uses the NTK base for seq_len max(p + 1, max_position_embeddings);
- longrope: the long factors where p + 1 > original_max_position_embeddings, the short ones below.

That is what transformers' cached generation computes whenever the prompt fits in that length (each decode
step is a forward whose largest position is the new token's). A longer prompt is rotated by transformers
with the whole prompt's frequencies in one forward, and differs here (docs/models.md).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import torch

from services.common.errors import InvalidArgument, Unsupported

RECIPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Not a config.json rope_type: a GGUF file's rope_freqs tensor (model/gguf_file.py), llama.cpp's way of
# storing Llama 3's bands: inv_freq[i] = 1 / (freq_factors[i] * theta^(2i / dim)), as ggml_rope_ext applies it.
FREQ_FACTORS = "freq_factors"

# Per recipe: keys it requires and keys it may have, besides rope_type/type and rope_theta (as transformers'
# _validate_*_rope_parameters). A key a recipe would not apply is refused rather than dropped.
_REQUIRED = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
             "yarn": ("factor",), "longrope": ("short_factor", "long_factor"),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
_OPTIONAL = {"default": (), "linear": (), "dynamic": (),
             "yarn": ("original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
                      "mscale_all_dim", "truncate"),
             "longrope": ("original_max_position_embeddings", "attention_factor", "factor"),
             "llama3": ("original_max_position_embeddings",)}
# Recipes whose pretraining length transformers fills in from max_position_embeddings when absent.
_ORIGINAL_LENGTH = ("yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """One checkpoint's RoPE recipe and its parameters, as transformers reads them."""

    kind: str = "default"
    theta: float = 10000.0
    max_position_embeddings: int = 2048
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None         # llama3
    high_freq_factor: float | None = None        # llama3
    attention_factor: float | None = None        # yarn, longrope
    beta_fast: float | None = None               # yarn
    beta_slow: float | None = None               # yarn
    mscale: float | None = None                  # yarn
    mscale_all_dim: float | None = None          # yarn
    truncate: bool = True                        # yarn
    short_factor: tuple[float, ...] | None = None   # longrope
    long_factor: tuple[float, ...] | None = None    # longrope
    # llama.cpp's rope_freqs (a GGUF file's Llama 3 RoPE): per pair, the divisor of the unscaled frequency.
    freq_factors: tuple[float, ...] | None = None
    # The share of each head that rotates (Phi-4-mini: 0.75): the first int(head_dim * factor) dims, as
    # transformers' inits size the tables; the rest pass through. Only families that slice q/k accept it.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dims of a head_dim-wide head rotate (the tables' width)."""
        return int(head_dim * self.partial_rotary_factor)

    @property
    def switch_position(self) -> int | None:
        """The first position whose frequencies differ from position 0's (dynamic, longrope), else None."""
        if self.kind == "dynamic":
            return self.max_position_embeddings
        if self.kind == "longrope":
            return self.original_max_position_embeddings
        return None

    def describe(self) -> str:
        """The recipe in words for the load log, e.g. "llama3 theta=500000 factor=8 ..."."""
        words = [self.kind, f"theta={self.theta:g}"]
        for f in fields(self)[3:]:
            if f.name == "partial_rotary_factor":
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                words.append(f"{f.name}=[{len(value)} values]")
            elif isinstance(value, float):
                words.append(f"{f.name}={value:g}")
            elif value is not None and f.name != "truncate":
                words.append(f"{f.name}={value}")
        if self.kind == "yarn" and not self.truncate:
            words.append("truncate=False")
        if self.partial_rotary_factor != 1.0:
            words.append(f"partial_rotary_factor={self.partial_rotary_factor:g}")
        return " ".join(words)


def parse(raw: dict) -> tuple[RopeScaling, tuple[int, int, int] | None]:
    """(recipe, M-RoPE sections) from transformers 5's rope_parameters, or the legacy rope_scaling and
    top-level rope_theta. Raises Unsupported / InvalidArgument with one line naming the config key."""
    key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = dict(raw.get(key) or {})
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind == "mrope":      # transformers 4's Qwen2-VL spelling of unscaled M-RoPE
        kind = "default"
    if kind not in RECIPES:
        raise Unsupported(f"config.json {key}.rope_type {kind!r} is not supported (supported: {', '.join(RECIPES)})")
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    sections = params.pop("mrope_section", None)
    # As transformers' convert_rope_params_to_dict: the recipe's own value wins over a top-level one.
    partial = params.pop("partial_rotary_factor", None)
    partial = raw.get("partial_rotary_factor", 1.0) if partial is None else partial
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise InvalidArgument(f"config.json partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    if params.pop("mrope_interleaved", False):
        raise Unsupported(f"config.json {key}.mrope_interleaved (interleaved M-RoPE) is not supported")
    missing = [k for k in _REQUIRED[kind] if params.get(k) is None]
    if missing:
        raise InvalidArgument(f"config.json {key} lacks {missing[0]!r}, which rope_type {kind!r} requires")
    unknown = sorted(set(params) - set(_REQUIRED[kind]) - set(_OPTIONAL[kind]))
    if unknown:
        raise Unsupported(f"config.json {key}.{unknown[0]} is not supported with rope_type {kind!r} "
                          f"(it takes {', '.join(_REQUIRED[kind] + _OPTIONAL[kind]) or 'only rope_theta'})")
    if sections is not None:
        if kind != "default":
            raise Unsupported(f"config.json {key}: rope_type {kind!r} with mrope_section is not supported")
        if len(sections) != 3 or min(sections) < 0:
            raise InvalidArgument(f"mrope_section must be three non-negative pair counts, got {sections}")
        sections = tuple(int(s) for s in sections)
    max_pos = int(raw.get("max_position_embeddings", 2048))
    original = None
    if kind in _ORIGINAL_LENGTH:
        # As transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3) wins,
        # then the recipe's own, then max_position_embeddings.
        original = int(raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                       or max_pos)
    numbers = {name: _number(params, name, key) for name in ("factor", "low_freq_factor", "high_freq_factor",
                                                             "attention_factor", "beta_fast", "beta_slow",
                                                             "mscale", "mscale_all_dim")}
    rope = RopeScaling(kind=kind, theta=float(theta), max_position_embeddings=max_pos,
                       original_max_position_embeddings=original, truncate=bool(params.get("truncate", True)),
                       short_factor=_factors(params, "short_factor", key),
                       long_factor=_factors(params, "long_factor", key), partial_rotary_factor=float(partial),
                       **numbers)
    return rope, sections


def _number(params: dict, name: str, key: str) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"config.json {key}.{name} must be a number, got {value!r}")
    return float(value)


def _factors(params: dict, name: str, key: str) -> tuple[float, ...] | None:
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise InvalidArgument(f"config.json {key}.{name} must be a list of numbers")
    return tuple(float(v) for v in value)


def check_dims(rope: RopeScaling, head_dim: int) -> None:
    """Refuse, at load, parameters that cannot fit heads of head_dim (rotating rope.rotary_dim of them)."""
    dim = rope.rotary_dim(head_dim)
    if dim < 2 or dim % 2:
        raise InvalidArgument(f"config.json partial_rotary_factor {rope.partial_rotary_factor:g} of head_dim "
                              f"{head_dim} leaves {dim} rotary dims; rotary pairs need an even number of at least 2")
    if rope.kind == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(getattr(rope, name)) != dim // 2:
                raise InvalidArgument(f"config.json rope_parameters.{name} has {len(getattr(rope, name))} values; "
                                      f"the rotary dimension {dim} needs {dim // 2}")
    if rope.kind == FREQ_FACTORS and len(rope.freq_factors) != dim // 2:
        raise InvalidArgument(f"GGUF tensor rope_freqs.weight has {len(rope.freq_factors)} values; the rotary "
                              f"dimension {dim} needs {dim // 2}")
    if rope.kind == "llama3" and rope.high_freq_factor == rope.low_freq_factor:
        raise InvalidArgument("config.json rope_parameters.high_freq_factor must differ from low_freq_factor")


def inverse_frequencies(rope: RopeScaling, dim: int, device: torch.device | str = "cpu",
                        seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention factor on cos and sin) as transformers' ROPE_INIT_FUNCTIONS compute
    them for rotary dimension `dim`; seq_len as transformers passes it (dynamic, longrope)."""
    return _RECIPE[rope.kind](rope, dim, torch.device(device), seq_len)


def _exponents(dim: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim


def _default(rope: RopeScaling, dim: int, device: torch.device, seq_len) -> tuple[torch.Tensor, float]:
    return 1.0 / (rope.theta ** _exponents(dim, device)), 1.0


def _linear(rope: RopeScaling, dim: int, device: torch.device, seq_len) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (rope.theta ** _exponents(dim, device))
    inv_freq /= rope.factor
    return inv_freq, 1.0


def _dynamic(rope: RopeScaling, dim: int, device: torch.device, seq_len) -> tuple[torch.Tensor, float]:
    """seq_len None: transformers' init (Python floats); an int: its per-forward recompute, where seq_len is
    an int64 tensor and the base a 0-dim fp32 tensor."""
    max_pos, factor = rope.max_position_embeddings, rope.factor
    if seq_len is None:
        base = rope.theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    else:
        length = torch.maximum(torch.tensor(seq_len, dtype=torch.int64, device=device),
                               torch.tensor(max_pos, dtype=torch.int64, device=device))
        base = rope.theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim, device)), 1.0


def _yarn(rope: RopeScaling, dim: int, device: torch.device, seq_len) -> tuple[torch.Tensor, float]:
    base, original, factor = rope.theta, rope.original_max_position_embeddings, rope.factor

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001    # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _longrope(rope: RopeScaling, dim: int, device: torch.device, seq_len) -> tuple[torch.Tensor, float]:
    original = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else rope.max_position_embeddings / original
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = rope.long_factor if seq_len and seq_len > original else rope.short_factor
    ext_factors = torch.tensor(chosen, dtype=torch.float32, device=device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext_factors * rope.theta ** shape), attention_factor


def _llama3(rope: RopeScaling, dim: int, device: torch.device, seq_len) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (rope.theta ** _exponents(dim, device))
    factor, low_freq_factor, high_freq_factor = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated smoothly.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama), 1.0


def _freq_factors(rope: RopeScaling, dim: int, device: torch.device, seq_len) -> tuple[torch.Tensor, float]:
    factors = torch.tensor(rope.freq_factors, dtype=torch.float32, device=device)
    return 1.0 / (factors * rope.theta ** _exponents(dim, device)), 1.0


_RECIPE = {"default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "longrope": _longrope,
           "llama3": _llama3, FREQ_FACTORS: _freq_factors}


@functools.lru_cache(maxsize=8192)
def dynamic_frequencies(rope: RopeScaling, dim: int, position: int, device: str) -> torch.Tensor:
    """inv_freq [dim/2] of the token at `position` under `dynamic`: the NTK base for seq_len position + 1, as
    transformers recomputes it for a forward whose largest position that is. Cached: a decode step asks for
    one per running request past max_position_embeddings."""
    return _dynamic(rope, dim, torch.device(device), position + 1)[0]
