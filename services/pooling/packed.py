"""A packed forward (fp32, or bf16 with --dtype bfloat16) for BERT-family encoders: no padding in any
linear layer.

Why: on CPU the linear layers dominate a small encoder's forward. transformers'
BertModel runs them over the padded [B, L] grid and splits Q/K/V into three GEMMs.
Here tokens of all rows are concatenated into one [T, H] matrix (T = real tokens),
Q/K/V is one fused GEMM, and only attention is padded (briefly, per row length).
It computes exactly BertModel's function; tests compare it with transformers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.common import linear_path

_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class PackedBert:
    """Callable: list of Sequence -> (hidden [B, L, H] right-padded, mask [B, L])."""

    @classmethod
    def wrap(cls, model: torch.nn.Module, mode: str | None = None) -> PackedBert | None:
        """A PackedBert over model's weights, or None when model is not a plain BertModel.

        mode: the matmul path (services/common/linear_path.py): auto (timed), packed or plain."""
        cfg = model.config
        if (type(model).__name__ != "BertModel" or getattr(cfg, "is_decoder", False)
                or getattr(cfg, "position_embedding_type", "absolute") != "absolute"
                or not isinstance(cfg.hidden_act, str) or cfg.hidden_act not in _GELU):
            return None
        return cls(model, mode)

    def __init__(self, model: torch.nn.Module, mode: str | None = None):
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.approximate = _GELU[cfg.hidden_act]
        emb = model.embeddings
        self.word = emb.word_embeddings.weight
        self.position = emb.position_embeddings.weight
        self.token_type = emb.token_type_embeddings.weight
        self.emb_norm = emb.LayerNorm
        # Every projection as a linear_path.Projection: oneDNN-packed or plain F.linear per
        # row count, as timed at load for each weight shape (services/common/linear_path.py).
        # Per layer: fused Q/K/V, attention output, FFN up, FFN down as (weight, bias).
        weights = []
        for layer in model.encoder.layer:
            att = layer.attention.self
            qkv = (torch.cat([att.query.weight, att.key.weight, att.value.weight]),
                   torch.cat([att.query.bias, att.key.bias, att.value.bias]))
            dense = (layer.attention.output.dense, layer.intermediate.dense, layer.output.dense)
            weights.append([qkv] + [(m.weight, m.bias) for m in dense])
        plan = linear_path.plan((wb for layer in weights for wb in layer), mode)
        self.linear_path = plan.summary   # reported by the Embedder's load log
        self.layers = []
        for layer, projections in zip(model.encoder.layer, weights, strict=True):
            qkv, out, up, down = (linear_path.Projection(w, b, plan) for w, b in projections)
            self.layers.append((qkv, out, layer.attention.output.LayerNorm, up, down, layer.output.LayerNorm))

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
        for qkv_proj, out_proj, out_norm, up, down, ffn_norm in self.layers:
            qkv = qkv_proj(x)                                                     # [T, 3H]
            grid = qkv.new_zeros(batch * width, 3 * hidden)
            grid[flat] = qkv
            q, k, v = grid.view(batch, width, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)     # [B, nh, L, d]
            ctx = ctx.transpose(1, 2).reshape(batch * width, hidden)[flat]        # [T, H]
            x = out_norm(out_proj(ctx) + x)
            x = ffn_norm(down(F.gelu(up(x), approximate=self.approximate)) + x)
        out = x.new_zeros(batch * width, hidden)
        out[flat] = x
        return out.view(batch, width, hidden), mask
