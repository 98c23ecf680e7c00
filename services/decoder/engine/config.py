"""The engine core's configuration: one frozen dataclass, validated once at start."""
from __future__ import annotations

import json
from dataclasses import dataclass


def _positive_int(name: str, value: object, owner: str = "EngineConfig") -> None:
    # bool is an int subclass; True as a block size is a config typo, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup (n-gram) speculative decoding, in vLLM's --speculative-config keys.

    Each step, a decoding request whose last n tokens (prompt_lookup_max >= n >= prompt_lookup_min,
    longest first) occurred earlier in its prompt + output proposes up to num_speculative_tokens of
    the tokens that followed there; one forward verifies them with everyone else's tokens.
    disable_by_batch_size: no drafts in a step that has at least this many running requests (from
    there the step is no longer bound by reading the weights, so verifying drafts costs more than it
    saves: on GSM8K chats, 21% accepted, 1.38x at 1 request, 1.02x at 4, 0.85x at 8; docs/operation.md).
    """

    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int = 4
    method: str = "ngram"

    KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method {self.method!r} is not supported; the only method is 'ngram'")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            _positive_int(name, getattr(self, name), "speculative config")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse --speculative-config. As in vLLM, a missing prompt_lookup_min or _max takes the other's
        value and both default to 5; num_speculative_tokens is required. Raises ValueError."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative config must be a JSON object")
        unknown = sorted(set(raw) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown}; known: {', '.join(cls.KEYS)}")
        if "method" not in raw:
            raise ValueError('speculative config needs "method" (only "ngram" is supported)')
        if "num_speculative_tokens" not in raw:
            raise ValueError('speculative config needs "num_speculative_tokens"')
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        raw["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else 5)
        raw["prompt_lookup_max"] = hi if hi is not None else raw["prompt_lookup_min"]
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps({k: getattr(self, k) for k in self.KEYS}, separators=(",", ":"))


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the paged KV cache and the per-step budget.

    block_size: tokens per KV block. num_blocks: blocks in the pool (the runner
    allocates its KV tensors as [num_blocks * block_size, ...] slots).
    max_num_batched_tokens: tokens per step over all requests (the chunk budget).
    max_num_seqs: requests running at once. max_model_len: the most positions a
    request may have (prompt + generated). eos_token_ids end generation unless a
    request sets ignore_eos. speculative: None, or n-gram drafting (SpeculativeConfig).
    vocab_size: the model's vocabulary; a prompt id at or past it is refused when the
    request is added (0: unknown, then only the runner refuses it, failing that request).
    attention_reach: when every layer of the model slides, its largest window in keys (a query at p reads
    keys p - reach + 1 .. p), so a request's blocks before that go back to the pool as it runs; None: the
    model reads its whole context. EngineCore takes it from a runner that declares it.
    """

    block_size: int = 16
    num_blocks: int = 1024
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    speculative: SpeculativeConfig | None = None
    vocab_size: int = 0
    attention_reach: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("EngineConfig.enable_prefix_caching must be a bool")
        if not isinstance(self.eos_token_ids, tuple) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"EngineConfig.eos_token_ids must be a tuple of token ids, got {self.eos_token_ids!r}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            raise ValueError(f"EngineConfig.vocab_size must be a non-negative int, got {self.vocab_size!r}")
        if self.attention_reach is not None:
            _positive_int("attention_reach", self.attention_reach)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError("EngineConfig.speculative must be a SpeculativeConfig or None")
