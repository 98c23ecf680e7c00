"""A packed fp32 forward for BERT-family encoders: no padding in any linear layer.

Why: on CPU the linear layers dominate a small encoder's forward. transformers'
BertModel runs them over the padded [B, L] grid and splits Q/K/V into three GEMMs.
Here tokens of all rows are concatenated into one [T, H] matrix (T = real tokens),
Q/K/V is one fused GEMM, and only attention is padded (briefly, per row length).
It computes exactly BertModel's function; tests compare it with transformers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.common import onednn

_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class PackedBert:
    """Callable: list of Sequence -> (hidden [B, L, H] right-padded, mask [B, L])."""

    @classmethod
    def wrap(cls, model: torch.nn.Module) -> PackedBert | None:
        """A PackedBert over model's weights, or None when model is not a plain BertModel."""
        cfg = model.config
        if (type(model).__name__ != "BertModel" or getattr(cfg, "is_decoder", False)
                or getattr(cfg, "position_embedding_type", "absolute") != "absolute"
                or not isinstance(cfg.hidden_act, str) or cfg.hidden_act not in _GELU):
            return None
        return cls(model)

    def __init__(self, model: torch.nn.Module):
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.approximate = _GELU[cfg.hidden_act]
        emb = model.embeddings
        self.word = emb.word_embeddings.weight
        self.position = emb.position_embeddings.weight
        self.token_type = emb.token_type_embeddings.weight
        self.emb_norm = emb.LayerNorm
        # Every projection as (weight, bias) for self._linear: oneDNN-packed on CPU (about 2x
        # F.linear there), plain tensors elsewhere.
        self.packed = onednn.available(self.word.device)
        self.layers = []
        for layer in model.encoder.layer:
            att = layer.attention
            qkv_w = torch.cat([att.self.query.weight, att.self.key.weight, att.self.value.weight])
            qkv_b = torch.cat([att.self.query.bias, att.self.key.bias, att.self.value.bias])
            self.layers.append((self._prepare(qkv_w, qkv_b), self._prepare(att.output.dense),
                                att.output.LayerNorm, self._prepare(layer.intermediate.dense),
                                self._prepare(layer.output.dense), layer.output.LayerNorm))

    def _prepare(self, weight, bias=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(weight, torch.nn.Linear):
            weight, bias = weight.weight, weight.bias
        weight = weight.detach().contiguous()
        bias = None if bias is None else bias.detach().contiguous()
        return (onednn.pack(weight) if self.packed else weight), bias

    def _linear(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        return onednn.linear(x, *wb) if self.packed else F.linear(x, *wb)

    def __call__(self, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([len(s) for s in seqs])
        batch, width = len(seqs), int(lengths.max())
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)           # [B, L]
        flat = mask.reshape(-1).nonzero().squeeze(1)                              # [T] slots in B*L
        ids = torch.tensor([t for s in seqs for t in s.ids])
        positions = flat % width
        types = torch.tensor([t for s in seqs for t in (s.type_ids or (0,) * len(s))])
        x = self.word[ids] + self.position[positions] + self.token_type[types]
        x = self.emb_norm(x)                                                      # [T, H]
        hidden = x.shape[1]
        head_dim = hidden // self.heads
        key_mask = mask[:, None, None, :]                                         # [B, 1, 1, L]
        for qkv, out_dense, out_norm, up, down, ffn_norm in self.layers:
            qkv = self._linear(x, qkv)                                            # [T, 3H]
            grid = qkv.new_zeros(batch * width, 3 * hidden)
            grid[flat] = qkv
            q, k, v = grid.view(batch, width, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)     # [B, nh, L, d]
            ctx = ctx.transpose(1, 2).reshape(batch * width, hidden)[flat]        # [T, H]
            x = out_norm(self._linear(ctx, out_dense) + x)
            x = ffn_norm(self._linear(F.gelu(self._linear(x, up), approximate=self.approximate), down) + x)
        out = x.new_zeros(batch * width, hidden)
        out[flat] = x
        return out.view(batch, width, hidden), mask
