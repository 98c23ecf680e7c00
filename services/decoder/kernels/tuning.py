"""Launch-size helpers shared by the LoRA kernels."""
from __future__ import annotations

import functools
import os

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def block_r(rank: int) -> int:
    """Rank tile: a power of two covering the padded rank, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(rank))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device (cached); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
