"""What the Qwen2-VL and Qwen2.5-VL vision towers share, written from the architecture.

- The patch embedding: a Conv3d whose stride equals its kernel, i.e. a linear over each row's
  (C, T, P, P) values.
- The 2D axial rotary: each head's first half rotates by the patch's row h, the second by its column w,
  at coordinates laid out merge-window-major (see recipes.Qwen2VLRecipe.patchify).
- Attention with that rotary over row segments that never attend to each other (frames, images, and
  Qwen2.5-VL's windows).
- Loading checkpoint tensors under exact names: every key must match, none is left over.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}

Grid = tuple[int, int, int]


def vision_config(path: Path) -> tuple[dict, dict, float]:
    """config.json -> (vision_config, the text model's keys, the vision rotary theta); refuses what no tower reads."""
    raw = json.loads(Path(path).read_text())
    v = raw.get("vision_config")
    if not isinstance(v, dict):
        raise ValueError(f"{path}: no vision_config (is this a Qwen2-VL checkpoint?)")
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"{path}: vision rope_type {rope['rope_type']!r} is not supported (axial only)")
    return v, raw.get("text_config") or raw, float(rope.get("rope_theta", 10000.0))


def check_output_width(path: Path, text: dict, width: int) -> None:
    """The merger's output must be the decoder's width, or the rows cannot replace embeddings."""
    if text.get("hidden_size") is not None and int(text["hidden_size"]) != width:
        raise ValueError(f"{path}: vision output width {width} != text hidden_size {text['hidden_size']}")


def check_heads(embed_dim: int, num_heads: int, hidden_act: str) -> None:
    if embed_dim % num_heads or (embed_dim // num_heads) % 4:
        raise ValueError("the vision width must split into heads whose width is a multiple of 4 (2D rotary)")
    if hidden_act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported ({sorted(ACTIVATIONS)})")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """q, k, v [N, H, D] -> [N, H, D]: full attention inside each segment of `lengths` rows, none across.

    Segments of equal length run as one batched call (Qwen2.5-VL's windows are mostly the same size);
    each batch element is the same computation as its segment alone.
    """
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    out = torch.empty_like(q)
    for n, segs in by_length.items():
        if n == 0:
            continue
        index = torch.cat([torch.arange(starts[i], starts[i] + n) for i in segs]).to(q.device)
        # [S*n, H, D] -> [S, H, n, D]
        qs, ks, vs = (t.index_select(0, index).reshape(len(segs), n, *t.shape[1:]).transpose(1, 2)
                      for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out.index_copy_(0, index, o.transpose(1, 2).reshape(len(segs) * n, *q.shape[1:]))
    return out


class Attention(nn.Module):
    """qkv (with bias) -> 2D rotary on q and k -> attention within segments -> proj."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [N, E]; cos/sin [N, head_dim]; lengths: rows per segment -> [N, E]."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).unbind(1)  # each [N, H, D]
        dtype = q.dtype
        # Rotary in float32 whatever the compute dtype, as the reference does.
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + rotate_half(q.float()) * s).to(dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(dtype)
        return self.proj(segment_attention(q, k, v, lengths).reshape(n, -1))


def patch_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """[N, 2] (h, w) patch coordinates in merge-window-major order, repeated per frame."""
    out = []
    for t, h, w in grids:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        hw = torch.stack([hh.reshape(block).transpose(1, 2).flatten(),
                          ww.reshape(block).transpose(1, 2).flatten()], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def rotary(grids: list[Grid], merge: int, head_dim: int, theta: float,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim]: the first half rotates by h, the second by w, then repeated."""
    # Computed here in float32, not kept as a buffer that .to(bf16) would round.
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    freqs = patch_positions(grids, merge)[..., None].float() * inv_freq  # [N, 2, head_dim/4]
    angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device), angles.sin().to(device)


def check_patches(patches: torch.Tensor, grids: list[Grid], patch_dim: int, merge: int) -> None:
    if patches.ndim != 2 or patches.shape[1] != patch_dim:
        raise ValueError(f"patches must be [N, {patch_dim}], got {list(patches.shape)}")
    if sum(t * h * w for t, h, w in grids) != patches.shape[0] or any(h % merge or w % merge for _, h, w in grids):
        raise ValueError("grids do not match the patches or the merge size")


def load_weights(tower: nn.Module, tensors: dict[str, torch.Tensor], our_name: Callable[[str], str],
                 dtype: torch.dtype, device: str) -> nn.Module:
    """tower with checkpoint tensors (keyed without the visual prefix) renamed by our_name; every key must match."""
    state = {}
    for name, tensor in tensors.items():
        if name == "patch_embed.proj.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)  # Conv3d [E, C, T, P, P] == linear over (C, T, P, P)
        state[our_name(name)] = tensor
    expected = set(tower.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"vision weights do not match the config: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    tower.load_state_dict(state, strict=True)
    return tower.to(device=device, dtype=dtype).eval()
