"""Tiny GGUF files for the decoder's tests, laid out as llama.cpp's convert_hf_to_gguf.py writes them.

`from_checkpoint` converts a tiny HF checkpoint (tests/decoder/model/checkpoints.py) the converter's way:
its metadata keys, tensor names, F32 1-D tensors, a llama's Q and K rows permuted by the converter's
`permute` (copied below), no output.weight when the embeddings are tied; matrices in F32, F16 or BF16, or
quantized by gguf.quants (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: gguf's reference quantizer). The converter itself
(bench/peers/llamacpp_convert.py) needs llama.cpp's source and a transformers-4 venv that `make bench-peers`
builds, so it cannot run in `make test`; what it writes is mirrored here and checked two ways (our loader and
transformers' GGUF loader agree on the file, and an F32 file computes the original checkpoint's logits).

`with_random_blocks` writes a file whose matrices are random K-quant blocks (gguf has no K-quant quantizer):
every code, scale and min drawn at random, the super-block scales finite.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter, quantize
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_WHOLE = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as written there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3: rope_freqs.weight."""
    rope_params = cfg["rope_parameters"]
    base = rope_params.get("rope_theta", 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope_params.get("factor", 8.0)
    low_freq_factor = rope_params.get("low_freq_factor", 1.0)
    high_freq_factor = rope_params.get("high_freq_factor", 4.0)
    old_context_len = rope_params.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def gguf_name(name: str) -> str:
    owner, _, leaf = name.rpartition(".")
    if owner in _WHOLE:
        return f"{_WHOLE[owner]}.{leaf}"
    _, _, layer, module = owner.split(".", 3)
    return f"blk.{layer}.{_LAYER[module]}.{leaf}"


def _metadata(w: GGUFWriter, arch: str, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    if "tokenizer.ggml.bos_token_id" not in w.kv_data[0]:     # else copy_vocabulary wrote the file's
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)


def _stored(arch: str, cfg: dict, name: str, t: torch.Tensor) -> np.ndarray:
    data = t.float().numpy()
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        data = permute(data, cfg["num_attention_heads"], cfg["num_attention_heads"])
    if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        data = permute(data, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    return data


def from_checkpoint(folder: Path, out: Path, qtype: T = T.F32) -> Path:
    """The HF checkpoint in folder (llama or qwen2) as a GGUF file `out` whose matrices are qtype."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["model_type"]
    state = load_file(folder / "model.safetensors")
    w = GGUFWriter(out, arch)
    _metadata(w, arch, cfg)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        data = _stored(arch, cfg, name, t)
        if data.ndim == 1 or qtype == T.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == T.F16:
            w.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), quantize(np.ascontiguousarray(data, dtype=np.float32), qtype),
                         raw_dtype=qtype)
    return _finish(w, out)


# The largest d drawn (random_blocks): weights of std near 0.075, about 1.2 / sqrt(hidden 256), so that each
# layer keeps its activations' scale (a larger spread makes a random network chaotic: rounding grows by layer).
_K_SCALES = {T.Q4_K: 4.5e-4, T.Q5_K: 2e-4, T.Q6_K: 0.8e-4}


def random_blocks(rows: int, cols: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / block * type_size] random K-quant bytes whose fp16 super-block scales are finite and sized
    so the weights are of the tiny checkpoints' magnitude."""
    size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // size, type_size), dtype=np.uint8)
    # Q6_K: d * sc * (q - 32) with |sc| < 128, |q - 32| <= 32; Q4_K/Q5_K: d * sc * q - dmin * m with sc, m < 64
    # and q < 16 (32): dmin = d * 7.5 (15.5) centres the weights about 0.
    top = _K_SCALES[qtype]
    d = rng.uniform(top / 4, top, raw.shape[0])
    halves = [(0, d)] if qtype != T.Q6_K else [(208, d)]
    if qtype != T.Q6_K:
        halves.append((2, d * (7.5 if qtype == T.Q4_K else 15.5)))
    for at, value in halves:
        raw[:, at:at + 2] = value.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def copy_vocabulary(w: GGUFWriter, source: Path) -> int:
    """Write the tokenizer.* metadata of the GGUF file `source` (its vocabulary, merges, special ids, chat template)
    into w; returns the vocabulary's size."""
    reader = GGUFReader(str(source))
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            kind = field.types[0]
            w.add_key_value(name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY
                            else None)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def with_random_blocks(out: Path, arch: str, types: dict[str, T], hidden: int = 256, intermediate: int = 512,
                       heads: int = 4, kv_heads: int = 2, layers: int = 2, vocab: int = 160, seed: int = 0,
                       tied: bool = False, vocabulary: Path | None = None) -> Path:
    """A random model of arch as a GGUF file: each matrix in types[its GGUF kind] ("attn_q", "ffn_down", "output",
    "token_embd", ...; default Q4_K) as random blocks (other types: random weights quantized by gguf), norms near 1
    and biases (qwen2) in F32; vocabulary: a GGUF file whose tokenizer (and vocabulary size) it takes."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(out, arch)
    if vocabulary is not None:
        vocab = copy_vocabulary(w, vocabulary)
    cfg = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=hidden,
               intermediate_size=intermediate, num_hidden_layers=layers, vocab_size=vocab,
               max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)
    _metadata(w, arch, cfg)
    head_dim = hidden // heads
    mats = {"token_embd": (vocab, hidden)} | ({} if tied else {"output": (vocab, hidden)})
    for i in range(layers):
        mats |= {f"blk.{i}.attn_q": (heads * head_dim, hidden), f"blk.{i}.attn_k": (kv_heads * head_dim, hidden),
                 f"blk.{i}.attn_v": (kv_heads * head_dim, hidden), f"blk.{i}.attn_output": (hidden, heads * head_dim),
                 f"blk.{i}.ffn_gate": (intermediate, hidden), f"blk.{i}.ffn_up": (intermediate, hidden),
                 f"blk.{i}.ffn_down": (hidden, intermediate)}
    for name, (rows, cols) in mats.items():
        qtype = types.get(name.rpartition(".")[2] if name.startswith("blk.") else name, T.Q4_K)
        raw = random_blocks(rows, cols, qtype, rng) if qtype in _K_SCALES else \
            quantize((0.075 * rng.standard_normal((rows, cols))).astype(np.float32), qtype)
        w.add_tensor(f"{name}.weight", raw, raw_dtype=qtype)
    norms = ["output_norm"] + [f"blk.{i}.{n}" for i in range(layers) for n in ("attn_norm", "ffn_norm")]
    for name in norms:
        w.add_tensor(f"{name}.weight", (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32))
    if arch == "qwen2":
        for i in range(layers):
            for kind, width in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                                ("attn_v", kv_heads * head_dim)):
                w.add_tensor(f"blk.{i}.{kind}.bias", (0.1 * rng.standard_normal(width)).astype(np.float32))
    return _finish(w, out)


def _finish(w: GGUFWriter, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
