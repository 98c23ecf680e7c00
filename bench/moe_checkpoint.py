"""The mixture-of-experts benchmark checkpoint of bench/decoder.py (g): Qwen3-30B-A3B's shape, fewer layers.

Every width is Qwen3-30B-A3B's (hidden 2048, 32 query and 4 KV heads of 128, 128 experts of 768 with 8 per
token and norm_topk_prob, a 151,936-token vocabulary, untied head); only num_hidden_layers is smaller, so
that it fits in memory and converts to GGUF quickly. The weights are random (normal, std 0.02, the norms 1),
written as transformers 5's save_pretrained writes a Qwen3-MoE (each expert's gate/up/down apart, one
safetensors file per layer), in bf16. SmolLM2's tokenizer files come along for the GGUF converter, which
pads the vocabulary past its 49,152 tokens; the prompts are SmolLM2 token ids, so every id is a real token.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
    attention_bias=False, hidden_act="silu", use_sliding_window=False, sliding_window=None, bos_token_id=1,
    eos_token_id=2, torch_dtype="bfloat16",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tensors_of_layer(cfg: dict, i: int, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer i's tensors under transformers' checkpoint names."""
    h, d, heads, kv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    size, experts = cfg["moe_intermediate_size"], cfg["num_experts"]

    def normal(*shape):
        return (0.02 * torch.randn(*shape, generator=gen)).to(dtype)

    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
           p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
           p + "self_attn.q_proj.weight": normal(heads * d, h), p + "self_attn.k_proj.weight": normal(kv * d, h),
           p + "self_attn.v_proj.weight": normal(kv * d, h), p + "self_attn.o_proj.weight": normal(h, heads * d),
           p + "self_attn.q_norm.weight": torch.ones(d, dtype=dtype),
           p + "self_attn.k_norm.weight": torch.ones(d, dtype=dtype),
           p + "mlp.gate.weight": normal(experts, h)}
    for e in range(experts):
        out[f"{p}mlp.experts.{e}.gate_proj.weight"] = normal(size, h)
        out[f"{p}mlp.experts.{e}.up_proj.weight"] = normal(size, h)
        out[f"{p}mlp.experts.{e}.down_proj.weight"] = normal(h, size)
    return out


LayerTensors = Callable[[dict, int, torch.Generator, torch.dtype], dict[str, torch.Tensor]]


def write(folder: Path, layers: int, tokenizer: Path, shape: dict | None = None, seed: int = 0,
          layer_tensors: LayerTensors = tensors_of_layer) -> Path:
    """Write the checkpoint (shape: QWEN3_30B_A3B unless given; layer_tensors(cfg, i, gen, dtype) gives layer i's
    tensors, tensors_of_layer unless given) with `layers` layers into folder, through a temporary folder renamed
    into place; a folder already there is kept. A shape with tie_word_embeddings stores no lm_head. Returns folder."""
    if (folder / "config.json").is_file():
        return folder
    cfg = {**(shape or QWEN3_30B_A3B), "num_hidden_layers": layers}
    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen, dtype = torch.Generator().manual_seed(seed), torch.bfloat16
    weight_map = {}
    files = [{"model.embed_tokens.weight": (0.02 * torch.randn(cfg["vocab_size"], cfg["hidden_size"],
                                                               generator=gen)).to(dtype)}]
    files += [None] * layers
    files.append({"model.norm.weight": torch.ones(cfg["hidden_size"], dtype=dtype)})
    if not cfg.get("tie_word_embeddings"):
        files[-1]["lm_head.weight"] = (0.02 * torch.randn(cfg["vocab_size"], cfg["hidden_size"],
                                                          generator=gen)).to(dtype)
    for n in range(len(files)):
        tensors = files[n] if files[n] is not None else layer_tensors(cfg, n - 1, gen, dtype)
        name = f"model-{n + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        files[n] = None                      # one layer in memory at a time
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    for f in TOKENIZER_FILES:
        if (tokenizer / f).is_file():
            shutil.copy2(tokenizer / f, tmp / f)
    tmp.replace(folder)
    return folder


def decode_bytes(cfg: dict, itemsize: int) -> dict[str, int]:
    """Weight bytes one batch-1 decode step reads, by part: the attention projections and norms, the router
    and the top-k experts of every layer, and the LM head (the embedding lookup reads one row: left out)."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    heads, kv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    attention = h * (heads + 2 * kv) * d + heads * d * h
    experts = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    return {"attention": layers * attention * itemsize, "router": layers * cfg["num_experts"] * h * itemsize,
            "experts": layers * experts * itemsize, "head": cfg["vocab_size"] * h * itemsize}
