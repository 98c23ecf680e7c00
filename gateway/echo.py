"""Completions `echo`: the prompt's own tokens and, with `logprobs`, their logprobs (what lm-evaluation-harness
scores log-likelihoods by: `echo: true, logprobs: k, max_tokens: 0`).

The decoder returns logprobs for the tokens it samples, not for a prompt's, so the gateway gets each prompt
token's logprob by teacher forcing: position i is a one-token greedy generation from the prompt's first i tokens
with `logit_bias` +100 on token i, which the sampler's raw logprobs (taken before biases, penalties and
temperature: services/decoder/runner/sampler.py) report unbiased, with the top alternatives beside. The first
token has no context, so its logprob is null (OpenAI's and vLLM's answer). If the bias ever failed to force the
token (some other logit above it by 100), the answer is an internal error rather than the wrong token's number.

Cost: one Generate per prompt token. The calls go in waves of WAVE, so each wave's prompts find the earlier
waves' blocks in the decoder's prefix cache and prefill only their new tail; a prompt is bounded by
MAX_ECHO_TOKENS. (One forward over the prompt in the engine would be cheaper; this needs no engine change and is
exact: the same model, kernels and numerics as decoding.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from services.common.errors import Internal, InvalidArgument
from services.common.pb import decoder_pb2

from . import routing
from .backends import Model
from .generation import Generation
from .tenants import cache_salt

MAX_ECHO_TOKENS = 2048
WAVE = 16
FORCE = 100.0     # the largest logit_bias the decoder accepts


@dataclass
class EchoedPrompt:
    """A prompt's text, ids, and (with logprobs) one TokenLogprob per id after the first (entries[0] is None)."""

    text: str
    ids: list[int]
    tokens: list[str] = field(default_factory=list)
    entries: list = field(default_factory=list)


async def echoed(request: Request, model: Model, prompt: str | list[int], top: int | None, rid: str) -> EchoedPrompt:
    """The prompt echoed; top None: no logprobs (text and ids only)."""
    route = routing.route(request, model)
    backend = await route.best()
    target = model.target()
    salt = cache_salt(request)   # the waves' blocks are the tenant's, like any of its prompts
    if isinstance(prompt, str):
        reply = await backend.call(backend.decoder.Tokenize, decoder_pb2.TokenizeRequest(
            **target, text=prompt, add_special_tokens=True), rid)
        ids, text = list(reply.token_ids), prompt
    else:
        ids = list(prompt)
        text = (await backend.call(backend.decoder.Detokenize, decoder_pb2.DetokenizeRequest(
            **target, token_ids=ids), rid, {"token_ids": "prompt"})).text
    if not ids:
        raise InvalidArgument("echo with logprobs needs a prompt of at least one token", param="prompt")
    echo = EchoedPrompt(text, ids)
    if top is None:
        return echo
    if len(ids) > MAX_ECHO_TOKENS:
        raise InvalidArgument(f"echo with logprobs scores at most {MAX_ECHO_TOKENS} prompt tokens, got {len(ids)}",
                              param="prompt")
    first = (await backend.call(backend.decoder.Detokenize, decoder_pb2.DetokenizeRequest(
        **target, token_ids=ids[:1]), rid)).text
    echo.tokens, echo.entries = [first], [None]
    for start in range(1, len(ids), WAVE):
        positions = range(start, min(start + WAVE, len(ids)))
        calls = [decoder_pb2.GenerateRequest(**target, token_ids=decoder_pb2.TokenIds(ids=ids[:i]),
                                             cache_salt=salt,
                                             sampling=decoder_pb2.SamplingParams(
                                                 temperature=0, max_tokens=1, logprobs=top, ignore_eos=False,
                                                 logit_bias={ids[i]: FORCE})) for i in positions]
        generation = Generation(route, calls, rid, 1, {"logprobs": "logprobs"})
        try:
            await generation.start()
            choices = await generation.collect()
        finally:
            await generation.aclose()
        for i, choice in zip(positions, choices, strict=True):
            entry = choice.logprobs[0] if choice.logprobs else None
            if entry is None or entry.token_id != ids[i]:
                raise Internal(f"scoring prompt token {i} did not force it (request_id={rid})")
            echo.tokens.append(entry.token)
            echo.entries.append(entry)
    return echo
