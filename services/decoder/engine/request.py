"""One generation request as the engine core tracks it. No torch here.

A request's tokens are its prompt followed by what it has generated so far;
KV exists for the first num_computed_tokens of them. Scheduling only ever moves
num_computed_tokens toward num_tokens (a prefill chunk, a one-token decode and a
recompute after preemption are all that same move).
"""
from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from services.decoder.engine.drafter import DraftRecord
from services.decoder.engine.step import CompiledGrammar, PlacedImages, PromptLogprob, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"            # waiting again, KV dropped, outputs and lease kept
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort" | "error" once finished, else None."""
        return self.value if self.finished else None


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})

# (start, end, key): a key that salts only the KV blocks overlapping physical
# positions [start, end), e.g. an image's content hash over its placeholder span.
SpanKey = tuple[int, int, Hashable]


@dataclass
class AdapterRef:
    """The LoRA adapter a request runs with. digest: the content digest it was admitted with (also in
    the request's extra_keys, so it salts every block hash). slot: the device slot its lease holds;
    the lease hook (services/decoder/lora/leases.py) sets it on acquire and clears it on release, and
    the runner reads it from each chunk. Each choice of an n > 1 request holds its own lease, hence
    its own AdapterRef."""

    name: str
    digest: str
    slot: int | None = None


class Request:
    """A request (or one of the n choices of an API request).

    request_id is unique inside the engine; parent_id/index name the API request
    and choice it answers. extra_keys salt every KV block hash (the adapter digest,
    M-RoPE sections); span_keys salt only the blocks they overlap. Both are fixed
    when the request is added (hashes are computed once and kept across
    preemption). images, the adapter's slot and grammar go to the runner in
    every chunk; adapter is this request's own copy (its slot is its lease's).
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams, *,
                 arrival_seq: int, arrival_time: float = 0.0, parent_id: str | None = None, index: int = 0,
                 extra_keys: tuple = (), span_keys: tuple[SpanKey, ...] = (),
                 images: PlacedImages | None = None, adapter: AdapterRef | None = None,
                 grammar: CompiledGrammar | None = None):
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.sampling = sampling
        self.arrival_seq = arrival_seq        # FCFS order; the latest arrival is preempted first
        self.arrival_time = arrival_time
        self.extra_keys = extra_keys
        self.span_keys = span_keys
        self.images = images
        self.adapter = None if adapter is None else AdapterRef(adapter.name, adapter.digest)
        self.grammar = grammar

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []        # the block table: block_ids[p // block_size] holds position p
        self.block_hashes: list[bytes] = []   # hashes of full blocks of all_token_ids, a chain from block 0
        self.num_cached_tokens = 0            # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.admitted = False                 # scheduled at least once
        self.holds_lease = False
        self.lease_refusals = 0               # schedules at which no adapter room was free for it
        self.stop_token_id: int | None = None
        self.error: str | None = None
        self.prompt_done = False              # its prompt has been fully computed at least once
        self.drafting = DraftRecord()         # speculative decoding: whether its drafts pay (DraftGate)
        self.prompt_reported = False          # its first output since prompt_done has been made
        # With sampling.prompt_logprobs: one entry per prompt position scored so far, position 0 None (no
        # context). Filled chunk by chunk; kept across preemption, so a recompute does not score again.
        self.prompt_logprobs: list[PromptLogprob | None] | None = (
            None if sampling.prompt_logprobs is None else [None])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Physical positions known so far: prompt + outputs."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt logprobs are still missing: its chunks are scored, and it reads no prefix-cache
        hits (positions served from the cache have no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def add_prompt_logprobs(self, start: int, entries: Sequence[PromptLogprob]) -> None:
        """Record a chunk's scores: entries[i] is prompt position start + 1 + i. Positions already held
        (a recompute) and positions past the prompt are ignored."""
        held = self.prompt_logprobs
        if held is None or start + 1 > len(held):
            return
        held.extend(entries[len(held) - start - 1:self.num_prompt_tokens - start - 1])

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={self.block_ids})")
