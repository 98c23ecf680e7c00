"""The paged KV cache tensors, owned by the runner and indexed by the engine's block ids.

Per layer, K and V are [num_blocks, block_size, num_kv_heads, head_dim]. Physical position
p of a request lives in slot block_table[p // block_size] * block_size + p % block_size of
the flat view [num_blocks * block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import torch

from services.common import arena


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu", huge_pages: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: a slot that is never written must not hold NaN bit patterns that a
        # masked-out read could still propagate through 0 * NaN. In huge pages on CPU: a step's
        # attention reads blocks scattered over all of it (services/common/arena.py).
        self.arena, tensors, self.pages = arena.zeros([(shape, dtype)] * (2 * num_layers), device,
                                                    huge_pages)
        self.k, self.v = tensors[:num_layers], tensors[num_layers:]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one layer as [num_blocks * block_size, num_kv_heads, head_dim] views."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """K and V bytes of one block over all layers (to size num_blocks from a memory budget)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
