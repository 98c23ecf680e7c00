"""Tiny random HF checkpoints written with transformers' save_pretrained (no hub).

Weights are re-drawn larger than transformers' 0.02 init (and norms and biases are made
non-trivial) so logits are far from uniform: greedy comparisons then do not hinge on ties,
and a loader that skipped biases or norm weights would be caught.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 160
_CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM), "granite": (GraniteConfig, GraniteForCausalLM),
            "olmo2": (Olmo2Config, Olmo2ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM),
            "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
            "mixtral": (MixtralConfig, MixtralForCausalLM),
            "gemma2": (Gemma2Config, Gemma2ForCausalLM), "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM)}
# Families whose RMSNorm weight is stored as an offset from 1 (the norm multiplies by 1 + weight).
_ONE_PLUS_NORMS = ("gemma2", "gemma3_text")

# Accumulation shape of these checkpoints (and the tiny chat models of the other decoder tests)
# for tests/tolerance.py: the longest dot product of a layer is the MLP's (intermediate size at
# most 128; contexts stay shorter), depth = 2 layers + the LM head.
TINY_SHAPE = {"k": 128, "depth": 3}
# The same checkpoints with int8-rounded activations (--quantization int8 and int4: tests/tolerance.py's int8 u is
# one rounding of one matmul's input): a layer rounds the inputs of its four projections (q/k/v, o, gate/up, down)
# and the head its own, so depth counts 2 * 4 + 1 roundings, as tests/decoder/model/test_moe_experts.py counts an
# expert block's two.
TINY_INT8_SHAPE = {"k": 128, "depth": 9}

# name -> (family, config overrides, save kwargs). Covers GQA ratios 1, 2, 4 (and 3), tied and
# untied, an odd head count, qk-norm, a head_dim unequal to hidden/heads, and sharded files; Granite
# with all four multipliers away from 1 (an attention scale unlike 1/sqrt(head_dim)) and every bias,
# OLMo 2's post-norm blocks and whole-projection q/k norms with biases.
CASES = {
    "llama_mha_untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False), {}),
    "llama_gqa4_tied_sharded": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                              tie_word_embeddings=True), dict(max_shard_size="20KB")),
    "qwen2_gqa2_odd_tied": ("qwen2", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                                          tie_word_embeddings=True), {}),
    "qwen3_odd3_gqa3_qknorm": ("qwen3", dict(num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                                             tie_word_embeddings=False), {}),
    "granite_gqa2_multipliers": ("granite", dict(num_attention_heads=4, num_key_value_heads=2,
                                                 tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                                 embedding_multiplier=3.0, residual_multiplier=0.4,
                                                 attention_multiplier=0.07, logits_scaling=1.5), {}),
    "olmo2_gqa4_postnorm": ("olmo2", dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
                                          tie_word_embeddings=False), {}),
    # Phi-3 (fused qkv_proj / gate_up_proj in the checkpoint) with whole-head rotary; Phi-4-mini's shape: GQA,
    # tied, partial_rotary_factor 0.75 (12 of 16 dims rotate); and its longrope (6 factors: the rotary dim's
    # pairs) switching at 32, past the 19-token forwards of the model tests, inside the engine tests' output.
    "phi3_mha_untied": ("phi3", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False), {}),
    "phi4mini_gqa4_partial_tied": ("phi3", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                                partial_rotary_factor=0.75), {}),
    "phi3_longrope_partial": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
                                           max_position_embeddings=128, original_max_position_embeddings=32,
                                           rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                                partial_rotary_factor=0.75,
                                                                short_factor=[1.0, 1.0, 1.1, 1.3, 1.6, 2.0],
                                                                long_factor=[1.0, 1.5, 2.5, 4.0, 7.0, 11.0])), {}),
    # Mixtures of experts, 8 experts top-2 (model/moe_decoder.py): Qwen3-MoE with norm_topk_prob and a dense
    # middle layer (mlp_only_layers), Qwen2-MoE's shared expert with unnormalised top-k, Mixtral with GQA 4.
    "qwen3_moe_8x2_dense_mid": ("qwen3_moe", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                                                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  norm_topk_prob=True, mlp_only_layers=[1],
                                                  tie_word_embeddings=False), {}),
    "qwen2_moe_8x2_shared": ("qwen2_moe", dict(num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                               num_experts_per_tok=2, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=48, norm_topk_prob=False,
                                               tie_word_embeddings=True), {}),
    "mixtral_8x2_gqa4": ("mixtral", dict(num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                                         num_experts_per_tok=2, intermediate_size=48, tie_word_embeddings=False),
                         dict(max_shard_size="40KB")),
    # Sliding windows shorter than the prompts: Mistral's on every layer, Qwen2's on layers from
    # max_window_layers (layer 0 full, layer 1 sliding).
    "mistral_gqa2_window8": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                             tie_word_embeddings=False), {}),
    "qwen2_sliding_layers": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                           sliding_window=6, max_window_layers=1, tie_word_embeddings=True), {}),
    # Gemma 2 and Gemma 3 text (model/gemma.py), local layer then global: windows of 5 and 6 keys, shorter than the
    # prompts; query_pre_attn_scalar unlike head_dim; soft-caps near the scores' and logits' spread so tanh bends
    # them; Gemma 3's global RoPE linear-scaled at base 1e6, its local layers' at their own base.
    "gemma2_gqa2_window_softcap": ("gemma2", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                  query_pre_attn_scalar=24, sliding_window=5,
                                                  attn_logit_softcapping=2.0, final_logit_softcapping=4.0,
                                                  tie_word_embeddings=True), {}),
    "gemma3_gqa4_local_rope": ("gemma3_text", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                                   query_pre_attn_scalar=20, sliding_window=6,
                                                   layer_types=["sliding_attention", "full_attention"],
                                                   rope_parameters={
                                                       "full_attention": dict(rope_type="linear", factor=4.0,
                                                                              rope_theta=1e6),
                                                       "sliding_attention": dict(rope_type="default",
                                                                                 rope_theta=1e4)},
                                                   tie_word_embeddings=False), {}),
}

# RoPE recipes (services/decoder/model/rope.py), sized so each recipe's parts are exercised at head_dim 16
# (8 rotary pairs) and these short contexts: llama3's three frequency bands, YaRN's ramp, and dynamic's and
# longrope's switch positions (16) inside a prompt plus its generation. Llama 3.1 is untied, 3.2 tied.
_LONG = [1.0, 1.2, 1.7, 2.5, 4.0, 6.5, 9.0, 12.0]
ROPE_CASES = {
    "llama31_llama3_rope": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                          max_position_embeddings=2048, rope_parameters=dict(
                                              rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=256)), {}),
    "llama32_llama3_rope_tied": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                               max_position_embeddings=2048, rope_parameters=dict(
                                                   rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                   low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_max_position_embeddings=128)), {}),
    "qwen25_yarn": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                       original_max_position_embeddings=32)), {}),
    "llama_linear_rope": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0)), {}),
    "qwen3_dynamic_rope": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=16, rope_parameters=dict(
                                             rope_type="dynamic", rope_theta=10000.0, factor=3.0)), {}),
    "llama_longrope": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                          original_max_position_embeddings=16,
                                                          short_factor=[1.0] * 4 + [1.1, 1.3, 1.6, 2.0],
                                                          long_factor=_LONG)), {}),
}


def build(root: Path, name: str, seed: int = 0, vocab_size: int = VOCAB) -> Path:
    """Write checkpoint `name` (with another vocabulary size if given) under root and return its folder."""
    family, overrides, save_kwargs = {**CASES, **ROPE_CASES}[name]
    config_cls, model_cls = _CLASSES[family]
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:         # scales near 1: Gemma's norms multiply by 1 + weight
                p.copy_((0 if family in _ONE_PLUS_NORMS else 1) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    folder = root / (name if vocab_size == VOCAB else f"{name}_vocab{vocab_size}")
    model.save_pretrained(folder, **save_kwargs)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0).save_pretrained(folder)
    return folder


def load_reference(folder: Path):
    """transformers' own model for a folder, fp32, eval (tests only)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def greedy_reference(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate for each prompt alone, eos ignored (the engine tests' expected tokens)."""
    model = load_reference(folder)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs
