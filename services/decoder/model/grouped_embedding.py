"""An embedding table kept in the grouped format (a GGUF file's quantized token_embd.weight).

A step reads a few rows of the table, so it need not be expanded: each lookup gathers its rows' codes, scales and
offsets and dequantizes only those (model/grouped.py), to the same values the whole table would hold expanded
(scale * code + offset in fp32, then the serving dtype). Llama 3's table is 128256 x 4096: 2 GiB in fp32, a
quarter of that in Q4_K.
"""
from __future__ import annotations

import torch
from torch import nn

from services.decoder.model import grouped
from services.decoder.model.grouped import GroupedWeight


class GroupedEmbedding(nn.Embedding):
    """nn.Embedding over a GroupedWeight [num_embeddings, embedding_dim]; `weight` stays an empty tensor of the
    serving dtype (what the rows are returned in)."""

    def __init__(self, table: GroupedWeight, dtype: torch.dtype):
        super().__init__(table.out_features, table.in_features, device="meta")
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.table = table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> rows [N, embedding_dim] in the serving dtype."""
        t = self.table
        rows = GroupedWeight(t.bits, t.group, input_ids.numel(), t.in_features, t.codes[input_ids],
                             t.scale[input_ids], t.offset[input_ids])
        return grouped.expand(rows, self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.describe()}"
