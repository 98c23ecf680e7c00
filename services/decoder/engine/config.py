"""The engine core's configuration: one frozen dataclass, validated once at start."""
from __future__ import annotations

from dataclasses import dataclass


def _positive_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a block size is a config typo, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the paged KV cache and the per-step budget.

    block_size: tokens per KV block. num_blocks: blocks in the pool (the runner
    allocates its KV tensors as [num_blocks * block_size, ...] slots).
    max_num_batched_tokens: tokens per step over all requests (the chunk budget).
    max_num_seqs: requests running at once. max_model_len: the most positions a
    request may have (prompt + generated). eos_token_ids end generation unless a
    request sets ignore_eos.
    """

    block_size: int = 16
    num_blocks: int = 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("EngineConfig.enable_prefix_caching must be a bool")
        if not isinstance(self.eos_token_ids, tuple) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"EngineConfig.eos_token_ids must be a tuple of token ids, got {self.eos_token_ids!r}")
