"""What the engine core reports to the layer above, per step and on demand. No torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.decoder.engine.step import PromptLogprob, SampledToken


@dataclass
class RequestOutput:
    """News for one choice of one API request after a step.

    new_tokens: tokens emitted this step, with the runner's logprobs: 0 or 1,
    or with speculative decoding a run of accepted drafts and the token after.
    finish_reason: None while running, else "stop" | "length" | "abort" |
    "error" (error carries a message). stop_token_id: the eos or stop
    token that ended the choice; it is the last of new_tokens and the layer
    above leaves it out of the text. Counts are totals so far, for usage.
    first: this is the choice's first output since its prompt was computed
    (num_prompt_tokens and num_cached_tokens are final). prompt_logprobs: on
    that output, for a request that asked: one entry per prompt token, the
    first None (no context).
    """

    request_id: str
    index: int
    new_tokens: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    first: bool = False
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def new_token_ids(self) -> list[int]:
        return [t.token_id for t in self.new_tokens]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """Live counters (GetModelInfo, /metrics). Token counts for the prefix cache. Speculative
    decoding: draft tokens proposed and accepted, and verifications (chunks that carried drafts)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    num_steps: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens; 0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per verification; 0 before any."""
        return self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0
