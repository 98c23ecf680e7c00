"""GenerateRequest.sampling (proto) -> engine SamplingParams, validated with clear errors."""
from __future__ import annotations

import math

from services.common.errors import InvalidArgument
from services.decoder.engine.step import SamplingParams
from services.decoder.text.stop import validate_stop_strings

MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0


def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number", param=name)
    return value


def sampling_params(msg, *, prompt_len: int, max_model_len: int, vocab_size: int, max_n: int,
                    max_logprobs: int) -> tuple[SamplingParams, bool]:
    """(SamplingParams, include_stop_str_in_output) from a decoder_pb2.SamplingParams.

    Unset max_tokens means "up to the context length" (at least 1).
    """
    temperature = _finite(msg.temperature, "temperature") if msg.HasField("temperature") else 1.0
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature:g}",
                              param="temperature")
    top_p = _finite(msg.top_p, "top_p") if msg.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1], got {top_p:g}", param="top_p")
    if msg.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {msg.top_k}", param="top_k")
    n = msg.n if msg.HasField("n") else 1
    if not 1 <= n <= max_n:
        raise InvalidArgument(f"n must be between 1 and {max_n}, got {n}", param="n")
    if msg.HasField("max_tokens"):
        max_tokens = msg.max_tokens
        if max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    else:
        max_tokens = max(1, max_model_len - prompt_len)
    logprobs = None
    if msg.HasField("logprobs"):
        if not 0 <= msg.logprobs <= max_logprobs:
            raise InvalidArgument(f"logprobs must be between 0 and {max_logprobs}, got {msg.logprobs}",
                                  param="logprobs")
        logprobs = msg.logprobs
    for name in ("presence_penalty", "frequency_penalty"):
        value = _finite(getattr(msg, name), name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidArgument(f"{name} must be in [-2, 2], got {value:g}", param=name)
    stop_ids = tuple(int(t) for t in msg.stop_token_ids)
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise InvalidArgument(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None, max_tokens=max_tokens,
        stop=validate_stop_strings(list(msg.stop)), stop_token_ids=stop_ids, n=n, logprobs=logprobs,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        ignore_eos=msg.ignore_eos)
    return params, msg.include_stop_str_in_output
