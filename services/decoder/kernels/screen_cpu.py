"""The candidate pass of the greedy argmax screen (model/screen.py) on CPU: the launcher and its torch ref.

The kernel is screen_cpu.cpp next to this file, compiled once per machine by native.load (`make
kernels`). Whether the screen runs at all is measured at load (model/screen.py); this module only
computes.
"""
from __future__ import annotations

from pathlib import Path

import torch

from services.common import native

SOURCE = Path(__file__).with_suffix(".cpp")
OPERATOR = native.Operator("screen_cpu", SOURCE)
load = OPERATOR.load      # the compiled module; native.BuildError with the reason when it cannot be had


def candidates(scores: torch.Tensor, radius: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """scores [M, V] fp32, radius [M] fp32, norms [V] fp32 -> int64 pairs [P, 2] (row, column), by row
    then column: the columns c of row r whose upper bound scores[r, c] + radius[r] * norms[c] reaches the
    row's largest lower bound max_j (scores[r, j] - radius[r] * norms[j])."""
    return load().candidates(scores.contiguous(), radius.float().contiguous(), norms.float().contiguous())


def candidates_ref(scores: torch.Tensor, radius: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    spread = torch.outer(radius.float(), norms.float())
    floor = (scores - spread).amax(dim=1, keepdim=True)
    return (scores + spread >= floor).nonzero()


if __name__ == "__main__":
    OPERATOR.main()
