"""A GGUF file (llama.cpp's single-file format) as the decoder's checkpoint: its metadata as our ModelConfig,
its tensors under our module names.

What loads: architectures `llama` (Llama, Mistral and the other Llama-layer models llama.cpp writes as llama) and
`qwen2`. Their metadata keys become config.json's (`{arch}.embedding_length` -> hidden_size, ...) and
ModelConfig.from_dict validates them as it validates a folder's config, so a GGUF model is refused for the same
reasons a folder is. Tied embeddings: the file has no `output.weight` (llama.cpp's rule, and transformers').
Llama 3's RoPE: the converter stores no llama3 parameters but a `rope_freqs.weight` tensor of per-frequency
divisors, which becomes the config's RoPE as llama.cpp applies it (model/rope.py FREQ_FACTORS).

Tensor names map one to one (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, TENSOR_NAMES).
llama.cpp's converter permutes the rows of a llama's Q and K projections (its rotary pairs (i, i + d/2) of a
head become adjacent rows (2i, 2i + 1)): `unpermute_rows` gives the inverse row order, applied to the stored
rows before anything else (a quantized row is whole blocks, so it moves as bytes). Qwen2's are stored as is.

Tensor types: F32, F16, BF16 load dense in the serving dtype; the quantized types of model/gguf_blocks.py
(SUPPORTED) load as grouped codes, never through floats; any other type is refused by `check` in one line
naming the type and the tensor, before a weight is read.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from services.common.errors import InvalidArgument, TesseraError, Unsupported
from services.decoder.model import gguf_blocks
from services.decoder.model import rope as rope_recipes
from services.decoder.model.config import ModelConfig
from services.decoder.model.grouped import GroupedWeight
from services.decoder.model.rope import RopeScaling

ARCHITECTURES = ("llama", "qwen2")
FREQS = "rope_freqs.weight"
SUFFIX = ".gguf"

# GGUF tensor name (blk.N. prefix dropped) -> ours (model.layers.N. prefix dropped); the rest are whole-model.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_WHOLE = re.compile(r"(\w+)\.(weight|bias)")
_VOCABULARY = tuple(f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "scores", "token_type"))


def is_gguf(model: str | Path) -> bool:
    """Whether --model names a GGUF file (by its suffix: a folder is a Hugging Face checkpoint)."""
    return str(model).lower().endswith(SUFFIX)


def our_name(stored: str) -> str | None:
    """A GGUF tensor name -> our parameter name, or None when we have no such module."""
    m = _LAYER.fullmatch(stored)
    if m is not None:
        layer, kind, leaf = m.groups()
        ours = _LAYER_NAMES.get(kind)
        return None if ours is None else f"model.layers.{layer}.{ours}.{leaf}"
    m = _WHOLE.fullmatch(stored)
    if m is not None and m.group(1) in _MODEL_NAMES:
        return f"{_MODEL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's `permute(w, n_head, n_head_kv)` of a Q or K projection with
    `heads` heads (Q: the attention heads, K: the KV heads) and `rows` rows: stored[order] is the original.

    The converter computes w.reshape(heads, 2, d/2, ...).swapaxes(1, 2): original row h*d + j*(d/2) + i
    lands at h*d + 2i + j. Reading stored rows at reshape(heads, d/2, 2).swapaxes(1, 2) inverts it."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


@dataclass(frozen=True)
class StoredTensor:
    """One GGUF tensor under our name: its type, our shape ([out, in] for a matrix) and its raw rows."""

    name: str                         # ours
    stored: str                       # the file's
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray                  # memory-mapped: [rows, cols] values, or [rows, bytes] blocks when quantized
    order: np.ndarray | None = None   # the row order that undoes the converter's permutation

    @property
    def quantized(self) -> bool:
        return self.qtype not in gguf_blocks.DENSE

    def _rows(self) -> np.ndarray:
        return self.data if self.order is None else self.data[self.order]

    def dense(self) -> torch.Tensor:
        """The tensor [shape] in its stored float type (fp32, fp16 or bf16), copied out of the map."""
        if self.quantized:
            raise ValueError(f"{self.stored} is {self.qtype.name}: read it with grouped()")
        rows = np.ascontiguousarray(self._rows())
        if self.qtype == GGMLQuantizationType.BF16:
            return torch.from_numpy(rows.view(np.int16).copy()).view(torch.bfloat16).reshape(self.shape)
        return torch.from_numpy(rows.copy()).reshape(self.shape)

    def grouped(self) -> GroupedWeight:
        """The quantized matrix [out, in] as a grouped weight (model/gguf_blocks.py)."""
        out, cols = self.shape
        return gguf_blocks.decode(self._rows(), self.qtype, out, cols)


class GGUFModel:
    """An opened GGUF file: `config` (our ModelConfig), `metadata` (key -> value), `tensors()` under our names.

    `GGUFModel.open` keeps the last files opened: gguf's reader parses every metadata value up front, the
    vocabulary's strings too (seconds for a 128k vocabulary), and a start reads the file's metadata three
    times (the pre-start check, the KV cache's sizing, the load)."""

    @staticmethod
    def open(path: str | Path) -> GGUFModel:
        """The GGUFModel of path, shared while the file is unchanged (same size and modification time)."""
        path = Path(path)
        if not path.is_file():
            raise InvalidArgument(f"{path} is not a file")
        stat = path.stat()
        return _opened(str(path.resolve()), stat.st_size, stat.st_mtime_ns)

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise InvalidArgument(f"{self.path} is not a file")
        try:
            self.reader = GGUFReader(str(self.path))
        except (ValueError, OSError) as exc:   # a bad magic or version, a truncated file
            raise InvalidArgument(f"{self.path.name} is not a readable GGUF file: {str(exc).splitlines()[0]}") \
                from None
        if self.reader.byte_order != "I":   # the blocks' fp16 numbers are decoded as this machine stores them
            raise Unsupported(f"{self.path.name} is a GGUF file of the other byte order, which is not supported")
        # The vocabulary's arrays (tokens, merges, scores, types) stay in the map: the tokenizer reads them.
        self.metadata = {name: field.contents() for name, field in self.reader.fields.items()
                         if name not in _VOCABULARY}
        parts = self.metadata.get("split.count", 1)
        if parts != 1:
            raise Unsupported(f"{self.path.name} is one of {parts} parts of a split GGUF model, which is not "
                              "supported (merge the parts with llama-gguf-split --merge)")
        self.arch = self.metadata.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise Unsupported(f"{self.path.name}: GGUF architecture {self.arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
        self._stored = {t.name: t for t in self.reader.tensors}
        raw = self._config_json()
        try:
            config = ModelConfig.from_dict(raw, {})
        except TesseraError as exc:     # ModelConfig's refusal (in config.json's terms), named after this file
            raise type(exc)(f"{self.path.name}: {exc.message}", param=exc.param) from None
        self.config = self._with_freq_factors(config)

    @property
    def has_vocabulary(self) -> bool:
        """Whether the file has a tokenizer in its metadata (a tokenizer model and its tokens)."""
        return "tokenizer.ggml.model" in self.metadata and "tokenizer.ggml.tokens" in self.reader.fields

    def _key(self, name: str, default=None):
        return self.metadata.get(f"{self.arch}.{name}", default)

    def _config_json(self) -> dict:
        """The metadata as the config.json keys transformers' GGUF loader reads (ModelConfig validates them)."""
        need = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads"}
        raw: dict = {"model_type": self.arch}
        for key, ours in need.items():
            value = self._key(key)
            if not isinstance(value, int):
                raise InvalidArgument(f"{self.path.name}: GGUF metadata has no integer {self.arch}.{key}")
            raw[ours] = value
        heads = raw["num_attention_heads"]
        kv_heads = self._key("attention.head_count_kv", heads)
        if not isinstance(kv_heads, int):       # a list: per-layer KV heads (OpenELM-style), not these families'
            raise Unsupported(f"{self.path.name}: GGUF {self.arch}.attention.head_count_kv per layer is not supported")
        raw["num_key_value_heads"] = kv_heads
        head_dim = self._key("attention.key_length", raw["hidden_size"] // heads)
        if self._key("attention.value_length", head_dim) != head_dim:
            raise Unsupported(f"{self.path.name}: GGUF {self.arch}.attention.value_length unlike key_length "
                              "is not supported")
        rotary = self._key("rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise Unsupported(f"{self.path.name}: GGUF {self.arch}.rope.dimension_count {rotary} (partial rotary) "
                              f"is not supported for {self.arch} (head_dim {head_dim})")
        embed = self._stored.get("token_embd.weight")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._key("vocab_size") or (int(embed.shape[1]) if embed is not None else
                                             len(tokens.data) if tokens is not None else None)
        if vocab is None:
            raise InvalidArgument(f"{self.path.name}: GGUF has no token_embd.weight")
        raw.update(head_dim=head_dim, vocab_size=vocab, rms_norm_eps=self._key("attention.layer_norm_rms_epsilon",
                                                                                1e-6),
                   rope_theta=self._key("rope.freq_base", 10000.0),
                   max_position_embeddings=self._key("context_length", 2048),
                   tie_word_embeddings="output.weight" not in self._stored,
                   attention_bias="blk.0.attn_q.bias" in self._stored,
                   rope_scaling=self._rope_scaling())
        eos = [self.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        raw["eos_token_id"] = list(dict.fromkeys(int(e) for e in eos if e is not None)) or None
        raw["bos_token_id"] = self.metadata.get("tokenizer.ggml.bos_token_id")
        return raw

    def _with_freq_factors(self, cfg: ModelConfig) -> ModelConfig:
        """cfg with the file's rope_freqs tensor as its RoPE: how llama.cpp's converter stores Llama 3's bands
        (per-frequency divisors, computed from the checkpoint's llama3 parameters, not the parameters)."""
        stored = self._stored.get(FREQS)
        if stored is None:
            return cfg
        if cfg.rope is not None and cfg.rope.kind != "default":
            raise Unsupported(f"{self.path.name}: GGUF tensor {FREQS} with rope.scaling.type {cfg.rope.kind!r} is "
                              "not supported")
        if stored.tensor_type != GGMLQuantizationType.F32:
            raise Unsupported(f"{self.path.name}: GGUF tensor {FREQS} has type {stored.tensor_type.name}, "
                              "expected F32")
        rope = replace(cfg.rope or RopeScaling(theta=cfg.rope_theta), kind=rope_recipes.FREQ_FACTORS,
                       freq_factors=tuple(float(f) for f in np.asarray(stored.data, dtype=np.float32).ravel()))
        rope_recipes.check_dims(rope, cfg.head_dim)
        return replace(cfg, rope=rope)

    def _rope_scaling(self) -> dict | None:
        kind = self._key("rope.scaling.type", "none")
        linear = self._key("rope.scale_linear")     # the older spelling of linear scaling
        if kind == "none" and linear is None:
            return None
        if kind == "linear" or (kind == "none" and linear is not None):
            return {"rope_type": "linear", "factor": float(self._key("rope.scaling.factor", linear))}
        if kind == "yarn":
            scaling = {"rope_type": "yarn", "factor": float(self._key("rope.scaling.factor"))}
            original = self._key("rope.scaling.original_context_length")
            if original is not None:
                scaling["original_max_position_embeddings"] = int(original)
            return scaling
        raise Unsupported(f"{self.path.name}: GGUF {self.arch}.rope.scaling.type {kind!r} is not supported "
                          "(only none, linear, yarn)")

    def check_types(self) -> None:
        """Refuse, in one line naming the type and the tensor, the first tensor whose type does not load."""
        for t in self.reader.tensors:
            if t.tensor_type not in gguf_blocks.DENSE + gguf_blocks.SUPPORTED:
                loads = ", ".join(q.name for q in gguf_blocks.DENSE + gguf_blocks.SUPPORTED)
                raise Unsupported(f"{self.path.name}: GGUF tensor {t.name} has type {t.tensor_type.name}, which is "
                                  f"not supported (supported: {loads})")

    def tensors(self) -> Iterator[StoredTensor]:
        """Every tensor of the file under our name, Q/K rows in their original order; a tensor that names no
        module of ours is refused (serving without it would compute another model)."""
        cfg = self.config
        for t in self.reader.tensors:
            if t.name == FREQS:
                continue     # the config's RoPE (_with_freq_factors)
            name = our_name(t.name)
            if name is None:
                raise InvalidArgument(f"{self.path.name}: unexpected GGUF tensor {t.name!r} for a {self.arch} model")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            order = None
            if self.arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
                order = unpermute_rows(shape[0], heads)
            yield StoredTensor(name, t.name, t.tensor_type, shape, t.data, order)


@functools.lru_cache(maxsize=2)
def _opened(path: str, size: int, mtime_ns: int) -> GGUFModel:
    return GGUFModel(path)
