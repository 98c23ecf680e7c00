"""The one dtype vocabulary of every service: fp32, bf16, fp16.

Flags, configs and the model loaders all spell a dtype with these short names. The long torch spellings
(float32, bfloat16, float16) are accepted as aliases everywhere, so a flag written either way keeps
working, and `canonical` turns them into the short name before anything else sees them.

torch is imported only by `to_torch` and `name_of`: config modules import this one, and reading a config
must not import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CANONICAL = ("fp32", "bf16", "fp16")
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# Every accepted spelling, short names first (config `choices`, --help).
NAMES = (*CANONICAL, *ALIASES)
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# --matmul-precision, torch's names for how float32 matmuls may compute (services/common/split_products.py).
MATMUL_PRECISIONS = ("highest", "high")
MATMUL_PRECISION_HELP = ("float32 matmuls: highest keeps every product in fp32; high lets many-row ones split each "
                         "product in bf16 halves on the tile unit (AMX) where that was faster at load, about 2^-17 "
                         "of sum |x w| off (torch's 'high')")


def canonical(name: str, allowed: tuple[str, ...] = CANONICAL) -> str:
    """The short name of `name` (either spelling, any case); ValueError, one line, when it is unknown or
    not in `allowed` (canonical names)."""
    low = str(name).strip().lower()
    short = ALIASES.get(low, low)
    if short not in allowed:
        spelled = ", ".join(f"{n} ({_TORCH_NAMES[n]})" for n in allowed)
        raise ValueError(f"unknown dtype {name!r}: choose from {spelled}")
    return short


def names(allowed: tuple[str, ...] = CANONICAL) -> tuple[str, ...]:
    """Every spelling of the canonical names in `allowed`: a config option's choices."""
    return (*allowed, *(alias for alias, short in ALIASES.items() if short in allowed))


def to_torch(name: str, allowed: tuple[str, ...] = CANONICAL) -> torch.dtype:
    """The torch dtype of `name` (either spelling); ValueError as `canonical`."""
    import torch

    return getattr(torch, _TORCH_NAMES[canonical(name, allowed)])


def name_of(dtype: torch.dtype) -> str:
    """The short name of a torch dtype; ValueError for one outside the vocabulary."""
    for short, long in _TORCH_NAMES.items():
        if str(dtype) == f"torch.{long}":
            return short
    raise ValueError(f"dtype {dtype} has no name here: choose from {', '.join(CANONICAL)}")
