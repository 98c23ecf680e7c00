"""One adapter's validated, effective weights and their content digest.

`prepare_weights` is the single gate every adapter passes (PEFT folders and the direct
API alike): it checks every target, shape, rank and value, folds the scale into B and
casts to the serving dtype, all on host copies. Nothing touches a device slot here, so a
refusal can never leave a half-written adapter behind.

The digest is a sha256 over exactly what the decoder will consume (module names, shapes,
dtype and the bytes of A and scaled B). It salts prefix-cache block hashes: a slot number
or a name would let a reloaded adapter hit KV computed with other weights, while equal
content under two names may (and should) share KV.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument

# The projections an adapter may target, in the order transformers' layers use them.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraWeights:
    """Effective weights of one adapter, on the host, in the serving dtype.

    modules: full module name (e.g. "model.layers.0.self_attn.q_proj") -> (A [r, in],
    B [out, r]) with the scale already folded into B. rank: r (one rank for every
    module). targets: the projection kinds covered, e.g. ("q_proj", "v_proj").
    digest: sha256 hex of the content (see module docstring).
    """

    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    targets: tuple[str, ...]
    digest: str

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def leaf(module_name: str) -> str:
    return module_name.rsplit(".", 1)[-1]


def prepare_weights(raw: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *,
                    layers: Mapping[str, tuple[int, int]], max_rank: int, dtype: torch.dtype,
                    alpha: float | None = None, source: str = "adapter") -> LoraWeights:
    """Validate raw (module -> (A [r, in], B [out, r])) and return the effective LoraWeights.

    layers: the bank's wrapped modules -> (in_features, out_features). alpha: the LoRA
    alpha; the scale alpha / r is folded into B (None: scale 1). Raises InvalidArgument
    naming the module and the problem for: no modules, a module the bank does not wrap,
    non-2-D tensors, a rank of 0 or above max_rank, ranks that differ between modules,
    shapes that do not match the base projection, NaN/Inf before or after scaling and
    the cast to dtype.
    """
    if not raw:
        raise InvalidArgument(f"{source}: no LoRA weights", param="lora_path")
    ranks = set()
    prepared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in sorted(raw):
        a, b = raw[name]
        if name not in layers:
            kinds = sorted({leaf(n) for n in layers})
            raise InvalidArgument(f"{source}: target {name!r} is not an adapter target of this server "
                                  f"(wrapped projections: {', '.join(kinds)}; see --lora-targets)",
                                  param="lora_path")
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != 2 or b.dim() != 2:
            raise InvalidArgument(f"{source}: {name}: lora_A and lora_B must be 2-D tensors", param="lora_path")
        in_features, out_features = layers[name]
        rank = a.shape[0]
        if rank < 1:
            raise InvalidArgument(f"{source}: {name}: rank must be at least 1", param="lora_path")
        if rank > max_rank:
            raise InvalidArgument(f"{source}: {name}: rank {rank} exceeds the server's --max-lora-rank "
                                  f"{max_rank}", param="lora_path")
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise InvalidArgument(
                f"{source}: {name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                f"projection: expected ({rank}, {in_features}) / ({out_features}, {rank})", param="lora_path")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise InvalidArgument(f"{source}: {name}: weights must be floating point", param="lora_path")
        ranks.add(rank)
        scale = 1.0 if alpha is None else alpha / rank
        a32, b32 = a.detach().to("cpu", torch.float32), b.detach().to("cpu", torch.float32) * scale
        a_eff, b_eff = a32.to(dtype).contiguous(), b32.to(dtype).contiguous()
        # Check after scaling and the cast too: a large alpha or a bf16/fp16 cast can overflow.
        for part, tensor in (("lora_A", a32), ("lora_B", b32), ("lora_A", a_eff), ("lora_B", b_eff)):
            if not bool(torch.isfinite(tensor).all()):
                raise InvalidArgument(f"{source}: {name}.{part} has NaN or Inf values (after scaling to "
                                      f"{dtype})", param="lora_path")
        prepared[name] = (a_eff, b_eff)
    if len(ranks) != 1:
        raise InvalidArgument(f"{source}: modules have different ranks {sorted(ranks)}; one rank per adapter",
                              param="lora_path")
    if alpha is not None and not math.isfinite(alpha):
        raise InvalidArgument(f"{source}: lora_alpha must be finite", param="lora_path")
    targets = tuple(t for t in TARGETS if any(leaf(n) == t for n in prepared))
    return LoraWeights(prepared, ranks.pop(), targets, content_digest(prepared))


def content_digest(modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> str:
    """sha256 hex over sorted (name, shape, dtype, bytes) of every A and effective B."""
    h = hashlib.sha256(b"tessera-lora-v1")
    for name in sorted(modules):
        for part, tensor in zip(("A", "B"), modules[name], strict=True):
            h.update(f"{name}.{part}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
            h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
