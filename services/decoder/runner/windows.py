"""How far each layer's queries reach back, and the soft-capped attention SDPA cannot compute.

A layer with sliding window w lets a query at position p see keys p - w + 1 .. p (transformers'
sliding_window_overlay: kv_idx > q_idx - w); a full layer sees 0 .. p. The attention plan
(runner/attention.py) builds one key mask per distinct window of the model, and each layer picks its own;
gathers start at the first key any layer can still read (`reach`), so blocks before it, which the engine
may have returned to the pool (engine/kv_cache_manager.py), are never read.

A soft-cap (Gemma 2) turns the scaled scores into cap * tanh(scores / cap) before the softmax;
SDPA has no such step, so those layers run `softcapped_attention`, the same math written out in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Windows:
    """The model's attention reach: per layer its sliding window in keys (None: the whole context; () when
    every layer is full), and the soft-cap of the scores (None: none)."""

    layers: tuple[int | None, ...] = ()
    softcap: float | None = None

    def of(self, layer: int) -> int | None:
        return self.layers[layer] if self.layers else None

    @property
    def distinct(self) -> tuple[int | None, ...]:
        """Every window some layer has, each once (None for full layers)."""
        return tuple(dict.fromkeys(self.layers)) if self.layers else (None,)

    @property
    def reach(self) -> int | None:
        """The largest window when every layer slides (no key before p - reach + 1 is read again by any
        layer), else None."""
        if not self.layers or None in self.layers:
            return None
        return max(self.layers)

    def first_key(self, position: int) -> int:
        """The first key any layer reads for a query at `position`."""
        reach = self.reach
        return 0 if reach is None else max(0, position - reach + 1)


def binding(layer_windows: tuple[int | None, ...], capacity: int) -> tuple[int | None, ...]:
    """layer_windows with each window wider than `capacity` (the KV cache's slots) made None, () when none is
    left. A query at p reads min(p + 1, w) keys, all in blocks its request holds at once, so with w > capacity
    p + 1 <= capacity < w: such a window never hides a key (Phi-3's 262144 on a smaller cache)."""
    kept = tuple(None if w is not None and w > capacity else w for w in layer_windows)
    return kept if any(w is not None for w in kept) else ()


def key_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """query_pos [..., L], key_pos [..., S] -> bool [..., L, S], True where the query attends the key."""
    q, k = query_pos[..., :, None], key_pos[..., None, :]
    mask = k <= q
    return mask if window is None else mask & (k > q - window)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float | None, softcap: float) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, KVH, S, D] (query head h reads KV head h // (H / KVH)), mask bool broadcastable
    to [B, KVH, H / KVH, L, S] (True = attend; None: all) -> [B, H, L, D] in q's dtype:
    softmax(softcap * tanh(scale * q.k / softcap)) @ v, all in fp32."""
    b, h, length, d = q.shape
    kvh = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.float().reshape(b, kvh, h // kvh, length, d)
    s = torch.einsum("bkgld,bksd->bkgls", qg, k.float()) * scale
    s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    out = torch.einsum("bkgls,bksd->bkgld", torch.softmax(s, dim=-1), v.float())
    return out.reshape(b, h, length, d).to(q.dtype)
