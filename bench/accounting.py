"""Useful work of the load test's requests in FLOPs, against the machine's own fp32 GEMM rate.

Useful work counts what a request needed computed, not what the fleet spent on it: 2 FLOPs per weight of
every matrix a token passes through (the matmul weights: embedding tables are lookups, not products, unless
tied as the head), per computed prompt token (prefix-cache hits are not computed) and generated token of a
chat, per input token of an embedding; an image adds its vision encoder: 2 x (patch embedding + blocks)
weights per patch, the merger's per merged patch, and attention's 4 x patches^2 x width per block. Padding,
recomputation after preemption, rejected drafts and idle spinning are not useful work, so the fraction
shows all of them as the gap to 1.
"""
from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Tensors that are looked up, not multiplied (a tied head is counted as the head instead).
LOOKUPS = ("embed_tokens", "word_embeddings", "position_embeddings", "token_type_embeddings")


def gemm_flops(rounds: int = 5, reps: int = 10) -> float:
    """This machine's fp32 GEMM rate in FLOP/s at torch's current thread count: a 256-row matmul over a
    1024 x 4096 weight, after 3 warm-up calls, the best of `rounds` rounds of `reps` calls (other processes
    only ever add time, so the best round is the machine's own rate)."""
    x, w = torch.randn(256, 1024), torch.randn(1024, 4096)
    for _ in range(3):
        x @ w
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            x @ w
        best = min(best, (time.perf_counter() - start) / reps)
    return 2 * 256 * 1024 * 4096 / best


def tensor_shapes(folder: Path) -> dict[str, list[int]]:
    """name -> shape of every tensor in the folder's safetensors files, from their headers (no weights read)."""
    shapes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        shapes |= {name: entry["shape"] for name, entry in header.items()}
    return shapes


def _matrices(shapes: dict[str, list[int]], keep) -> int:
    """Elements of the weight matrices (and conv kernels) named `keep`: 1-D weights are norms, and stored
    buffers such as BERT's position_ids are not weights."""
    return sum(math.prod(s) for name, s in shapes.items() if name.endswith(".weight") and len(s) >= 2 and keep(name))


@dataclass(frozen=True)
class ModelWork:
    """FLOPs per token of a language model or encoder, and per image of its vision encoder (0: none)."""

    token_flops: float
    image_flops: float = 0.0

    @classmethod
    def from_folder(cls, folder: Path, image_rgb=None) -> ModelWork:
        """The model's matmul weights from its headers; image_rgb ([H, W, 3] uint8): the image the load test
        sends, whose patch grid the vision encoder's cost depends on (Qwen2-VL recipes only)."""
        folder = Path(folder)
        shapes = tensor_shapes(folder)
        config = json.loads((folder / "config.json").read_text())
        text = _matrices(shapes, lambda n: not n.startswith(("visual.", "pooler."))
                         and not any(k in n for k in LOOKUPS))
        if "lm_head.weight" not in shapes and config.get("tie_word_embeddings", False):
            text += _matrices(shapes, lambda n: "embed_tokens" in n)
        image = 0.0
        if image_rgb is not None and "vision_config" in config:
            from services.vision.recipes import Qwen2VLRecipe
            vision = config["vision_config"]
            recipe = Qwen2VLRecipe.from_folder(folder)
            grid_t, grid_h, grid_w = recipe(image_rgb).grid
            patches = grid_t * grid_h * grid_w
            per_patch = _matrices(shapes, lambda n: n.startswith("visual.") and not n.startswith("visual.merger"))
            merger = _matrices(shapes, lambda n: n.startswith("visual.merger"))
            width, depth = vision.get("embed_dim", vision.get("hidden_size")), vision["depth"]
            image = 2 * per_patch * patches + 2 * merger * patches / recipe.merge_size ** 2 \
                + 4 * patches ** 2 * width * depth
        return cls(2.0 * text, image)
