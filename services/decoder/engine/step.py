"""What the engine core hands the runner each step, and what it gets back. No torch here.

The scheduler has no prefill or decode phases: each step gives some running
requests a chunk of tokens toward their known tokens. A chunk that reaches the
end of the known tokens is sampled.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy. The runner's sampler applies them in
    vLLM's order (services/decoder/runner/sampler.py)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: disabled
    min_p: float = 0.0             # 0: disabled
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs: int | None = None    # None: no logprobs; k: chosen token + top-k alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs, ids distinct
    repetition_penalty: float = 1.0                   # 1: disabled; over prompt and output tokens
    min_tokens: int = 0            # stop tokens are neither sampled nor obeyed before this many outputs
    # None: none; k: every prompt token's logprob and top-k alternatives (vLLM's prompt_logprobs). With it,
    # max_tokens may be 0: the prompt is computed and scored, nothing sampled.
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class PlacedImages:
    """A prompt's images placed at their positions, as the runner consumes them (runner/batch.py).

    positions [3, T_prompt] long: M-RoPE (time, height, width) coordinates of every prompt position;
    delta: decode rotary position minus physical position; sections: the M-RoPE sections they were
    computed for (the runner refuses a model whose sections differ); rows: absolute position ->
    embedding row [hidden], put in place of the placeholder's embedding. Built by
    services/decoder/multimodal/prompt.py; torch values, but the engine only carries them.
    """

    positions: torch.Tensor
    delta: int
    sections: tuple[int, int, int] | None = None
    rows: Mapping[int, torch.Tensor] = field(default_factory=dict)


class CompiledGrammar(Protocol):
    """A structured-output grammar compiled by the server (services/decoder/grammar/compiled.py). The
    engine carries it to the runner's sampler and never looks inside (hence a protocol, not an import)."""

    @property
    def compiled(self) -> Any: ...      # the library's compiled grammar

    @property
    def bits(self) -> Any: ...          # the vocabulary's token masks it was compiled against


@dataclass
class ScheduledChunk:
    """One request's share of a step.

    token_ids are the tokens at physical positions start .. start+len-1; KV for
    positions < start is already in the cache. block_table covers at least
    start+len positions. sample is True when the chunk ends at the last known
    token, so its last row's logits choose the next token.

    Speculative decoding: draft_token_ids (d >= 0 of them) are the last d of
    token_ids, proposed after the last known token. Then the chunk's last d + 1
    rows are sampled: row j verifies draft j (the token it predicts must be that
    draft for the run to go on) and the last row gives the bonus token.
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
    # What the request brings besides tokens: its placed images (M-RoPE positions, image rows), the
    # adapter slot its lease holds (None: the base model) and its grammar. The runner keeps its own
    # per-request state (a grammar matcher) keyed by request_id, dropped by finished_request_ids.
    images: PlacedImages | None = None
    lora_slot: int | None = None
    grammar: CompiledGrammar | None = None
    # The whole prompt (the request's own tuple, not a copy): the repetition penalty covers it.
    prompt_token_ids: Sequence[int] = ()
    # Ids the sampler must not choose this step: the stop tokens while min_tokens is unmet. The
    # engine decides it, since it owns the stop rules (the EOS set includes the tokenizer's).
    blocked_token_ids: tuple[int, ...] = ()
    draft_token_ids: list[int] = field(default_factory=list)
    # k: the runner scores the prompt tokens after each of this chunk's rows that lie in the prompt
    # (row at position p scores prompt token p + 1), with top-k alternatives; None: no prompt logprobs
    # wanted from this chunk (the scheduler sets it only while a request's prompt logprobs are missing).
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token scored from the raw logits at the position before it: its log_softmax value, its
    rank in the vocabulary (1: the most likely) and the top alternatives as (token id, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepInput:
    chunks: list[ScheduledChunk]
    # Requests that finished (stop, length, abort, error) since the previous step:
    # the runner drops their per-request state (grammar matchers). A preempted
    # request is not listed; it comes back with the same id and its state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass
class SampledToken:
    """The runner's answer for one sampled chunk. complete: the request's constraint (its grammar,
    whose matcher the runner holds) is complete, nothing may follow this token: the engine ends the
    request with "stop", whatever min_tokens or ignore_eos say."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    complete: bool = False


@dataclass
class StepOutput:
    # request_id -> sampled token, for chunks with sample=True only.
    sampled: dict[str, SampledToken]
    # request_id -> the drafts the runner accepted, in order, for chunks with drafts: a prefix of
    # draft_token_ids (maybe empty). They come before `sampled` (the token sampled at the first
    # rejected draft, or the bonus token after the last draft). Absent: none accepted.
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request_id -> why the runner refused that request's chunk (a request-level fault: a token id
    # outside the vocabulary, an adapter slot without a bank, images the model cannot place). Its
    # chunk was not computed and it has no entry in sampled/accepted; the engine fails that request
    # alone and the step's other requests go on.
    failed: dict[str, str] = field(default_factory=dict)
    # request_id -> the prompt tokens its chunk scored (ScheduledChunk.prompt_logprobs): for a chunk at
    # start s, the entries for prompt positions s + 1, s + 2, ... up to the prompt's end.
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)


class Runner(Protocol):
    """What the engine core drives: one forward (plus sampling) per step.

    execute returns one SampledToken per chunk with sample=True, keyed by
    request_id, and for chunks with drafts the accepted ones. KV for position p of a chunk's request lives in slot
    block_table[p // block_size] * block_size + p % block_size. A chunk the runner refuses
    on its own account goes in StepOutput.failed: only its request fails. Raising fails the
    requests of that step only; the core stays usable (the server then stops serving,
    since a forward that raised leaves the device in an unknown state).
    """

    def execute(self, step: StepInput) -> StepOutput: ...
