"""What the engine core hands the runner each step, and what it gets back. No torch here.

The scheduler has no prefill or decode phases: each step gives some running
requests a chunk of tokens toward their known tokens. A chunk that reaches the
end of the known tokens is sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: disabled
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs: int | None = None    # None: no logprobs; k: chosen token + top-k alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False


@dataclass
class ScheduledChunk:
    """One request's share of a step.

    token_ids are the tokens at physical positions start .. start+len-1; KV for
    positions < start is already in the cache. block_table covers at least
    start+len positions. sample is True when the chunk ends at the last known
    token, so its last row's logits choose the next token.
    """

    request_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool
    sampling: SamplingParams
    # Tokens generated so far (penalties, seeded sampling); prompt length for positions.
    output_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    # Per-request features the runner consumes (M-RoPE positions, image rows, lora slot).
    features: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepInput:
    chunks: list[ScheduledChunk]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class SampledToken:
    """The runner's answer for one sampled chunk."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class StepOutput:
    # request_id -> sampled token, for chunks with sample=True only.
    sampled: dict[str, SampledToken]
