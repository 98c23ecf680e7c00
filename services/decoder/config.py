"""The decoder service's configuration: server, model, engine sizes and request limits."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.config import option
from services.common.server import ServerConfig


@dataclass(frozen=True)
class DecoderServerConfig(ServerConfig):
    """gRPC server options"""

    port: int = option(50052, "port to bind; 0 picks a free one")


@dataclass(frozen=True)
class DecoderConfig:
    """model and engine options"""

    model: str = option("", "HF model folder (config.json, safetensors, tokenizer.json)", metavar="DIR")
    served_model_name: str = option("", "name clients use in `model`; default: the folder's name")
    dtype: str = option("fp32", "weights and KV dtype (bf16 needs avx512_bf16 on CPU)",
                        choices=("fp32", "bf16", "fp16"))
    device: str = option("cpu", "torch device: cpu or cuda")
    threads: int = option(0, "torch intra-op threads; 0 keeps torch's default (all cores)")
    block_size: int = option(16, "tokens per KV block")
    num_blocks: int = option(0, "KV blocks in the pool; 0 sizes it from --kv-cache-gb")
    kv_cache_gb: float = option(1.0, "KV cache memory in GiB when --num-blocks is 0")
    max_num_batched_tokens: int = option(512, "token budget of one engine step (prefill chunk size)")
    max_num_seqs: int = option(64, "requests running at once")
    max_model_len: int = option(0, "longest prompt + output; 0 uses the model's max_position_embeddings")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of identical prompt prefixes")
    max_n: int = option(16, "largest `n` (choices per request)")
    max_logprobs: int = option(20, "largest number of top logprobs per token")
    seed: int = option(0, "base seed for unseeded sampling")
    max_images: int = option(8, "most images per request (vision-language models)")

    def __post_init__(self):
        if not self.model:
            raise ValueError("--model DIR is required")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_n", "max_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("num_blocks", "max_model_len", "threads", "max_logprobs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.kv_cache_gb <= 0:
            raise ValueError("kv_cache_gb must be positive")
