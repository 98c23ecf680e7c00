"""The real-size benchmark checkpoint of bench/real_size.py: Llama-3.2-1B's shape, random weights.

Every width is Llama-3.2-1B's (hidden 2048, 16 layers of 32 query and 8 KV heads of 64, intermediate 8192,
the llama3 RoPE recipe, a 128,256-token vocabulary, tied embeddings); --real-layers may make it shallower for
a smoke test. The weights are random (normal, std 0.02, the norms 1), written as transformers writes a Llama
(one safetensors file per layer), in bf16: 2.47 GB at 16 layers. No package ships Llama's tokenizer, so
SmolLM2's tokenizer files come along: the vocabulary of the weights stays 128,256 (the LM head reads every
row, as the real model's does), the GGUF converter pads the tokenizer past its 49,152 tokens, and the prompts
are SmolLM2 token ids, so every id is a real token.

The GGUF files llama.cpp serves are made once beside the other peers' (build/peers/gguf/): BF16 by the vendored
convert_hf_to_gguf.py, then Q8_0, Q4_0 and Q4_K_M from the BF16 file by llama-quantize (llama.cpp's own
recipe per type: a Q4 file keeps the tied head/embedding at Q6_K, as llama.cpp's published files do).
"""
from __future__ import annotations

from pathlib import Path

import torch

from bench import moe_checkpoint
from bench.peers import llamacpp

LLAMA_32_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu", bos_token_id=1,
    eos_token_id=2, torch_dtype="bfloat16",
)
LAYERS = 16
DIR = Path(__file__).resolve().parents[1] / "build" / "bench"
# GGUF types beside BF16, each made from the BF16 file by llama-quantize.
QUANTIZED = ("Q8_0", "Q4_0", "Q4_K_M")


def tensors_of_layer(cfg: dict, i: int, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer i's tensors of a dense Llama under transformers' checkpoint names."""
    h, d, heads, kv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    size = cfg["intermediate_size"]

    def normal(*shape):
        return (0.02 * torch.randn(*shape, generator=gen)).to(dtype)

    p = f"model.layers.{i}."
    return {p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "self_attn.q_proj.weight": normal(heads * d, h), p + "self_attn.k_proj.weight": normal(kv * d, h),
            p + "self_attn.v_proj.weight": normal(kv * d, h), p + "self_attn.o_proj.weight": normal(h, heads * d),
            p + "mlp.gate_proj.weight": normal(size, h), p + "mlp.up_proj.weight": normal(size, h),
            p + "mlp.down_proj.weight": normal(h, size)}


def write(layers: int, tokenizer: Path) -> Path:
    """The checkpoint with `layers` layers under build/bench/, written once."""
    name = "llama-3.2-1b-shape" if layers == LAYERS else f"llama-3.2-1b-shape-{layers}L"
    return moe_checkpoint.write(DIR / name, layers, tokenizer, LLAMA_32_1B, layer_tensors=tensors_of_layer)


def ggufs(folder: Path) -> tuple[dict[str, Path], str]:
    """({"BF16": path, "Q8_0": ..., "Q4_0": ..., "Q4_K_M": ...} made now where missing; why some are not, or "")."""
    bf16, why = llamacpp.gguf_of(folder, "bf16")
    if bf16 is None:
        return {}, why
    out, whys = {"BF16": bf16}, []
    for qtype in QUANTIZED:
        path, why = llamacpp.quantized(bf16, qtype)
        if path is None:
            whys.append(why)
        else:
            out[qtype] = path
    return out, "; ".join(dict.fromkeys(whys))

