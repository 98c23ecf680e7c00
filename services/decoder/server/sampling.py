"""GenerateRequest.sampling (proto) -> engine SamplingParams, validated with clear errors."""
from __future__ import annotations

import math

from services.common.errors import InvalidArgument
from services.decoder.engine.step import SamplingParams
from services.decoder.text.stop import validate_stop_strings

MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0    # OpenAI's range: -100 bans a token, 100 makes it all but certain


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
    # vLLM's convention: 0 and -1 both disable top-k.
    if msg.top_k < -1:
        raise InvalidArgument(f"top_k must be -1, 0 (both disable it) or positive, got {msg.top_k}", param="top_k")
    min_p = _finite(msg.min_p, "min_p") if msg.HasField("min_p") else 0.0
    if not 0.0 <= min_p <= 1.0:
        raise InvalidArgument(f"min_p must be in [0, 1], got {min_p:g}", param="min_p")
    repetition = _finite(msg.repetition_penalty, "repetition_penalty") if msg.HasField("repetition_penalty") \
        else 1.0
    if not repetition > 0.0:
        raise InvalidArgument(f"repetition_penalty must be > 0 (1 disables it), got {repetition:g}",
                              param="repetition_penalty")
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
    if not 0 <= msg.min_tokens <= max_tokens:
        raise InvalidArgument(f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {msg.min_tokens}",
                              param="min_tokens")
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(msg.top_k, 0), min_p=min_p,
        seed=msg.seed if msg.HasField("seed") else None, max_tokens=max_tokens,
        stop=validate_stop_strings(list(msg.stop)), stop_token_ids=stop_ids, n=n, logprobs=logprobs,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        ignore_eos=msg.ignore_eos, logit_bias=logit_bias(msg.logit_bias, vocab_size),
        repetition_penalty=repetition, min_tokens=msg.min_tokens)
    return params, msg.include_stop_str_in_output


def logit_bias(entries, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The proto map -> sorted (id, bias) pairs; ids in [0, vocab_size), biases in [-100, 100]."""
    out = []
    for token, bias in sorted(entries.items()):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})",
                                  param="logit_bias")
        if not -MAX_LOGIT_BIAS <= _finite(bias, "logit_bias") <= MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias:g}",
                                  param="logit_bias")
        out.append((int(token), float(bias)))
    return tuple(out)
