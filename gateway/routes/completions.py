"""POST /v1/completions in OpenAI's (legacy) text-completion shape, served by the decoder's Generate.

`prompt` takes OpenAI's four shapes; a list of prompts fans out into one Generate call per prompt
(at most MAX_PROMPTS), and their choices are numbered `prompt * n + j` in one answer.
"""
from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import Field, PlainValidator, WithJsonSchema

from services.common.errors import InvalidArgument
from services.common.pb import decoder_pb2

from .. import routing, sse
from ..backends import GENERATION
from ..echo import EchoedPrompt, echoed
from ..errors import request_id
from ..generation import Generation, SamplingFields, finish_reason
from ..limits import bill
from ..tenants import cache_salt
from .common import (
    ERROR_RESPONSES,
    INT32_MAX,
    TEXT_OR_TOKENS,
    TEXT_OR_TOKENS_SCHEMA,
    as_batch,
    catalog,
    check_text_or_tokens,
)

router = APIRouter()

MAX_PROMPTS = 16
_PROMPT_SCHEMA = {**TEXT_OR_TOKENS_SCHEMA,
                  "description": f"{TEXT_OR_TOKENS}; a list fans out into one generation per prompt"
                                 f" (at most {MAX_PROMPTS})"}


class CompletionRequest(SamplingFields):
    prompt: Annotated[object, PlainValidator(check_text_or_tokens), WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX,
                                   description="tokens to generate per choice (OpenAI's default 16);"
                                               " null: up to the context length; 0 only with echo (the prompt"
                                               " alone, as harnesses score it)")
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX,
                                 description="return each token's logprob and this many top alternatives")
    echo: bool = Field(False, description="the answer starts with the prompt; with logprobs, the prompt's tokens"
                                          " carry theirs (the first one's null); not with stream")
    best_of: int | None = Field(None, ge=1, le=INT32_MAX, description="only best_of == n is supported")
    suffix: str | None = Field(None, description="not supported: a suffix is refused")


def _logprobs(entries, offset: int) -> tuple[dict, int]:
    """OpenAI's completion logprobs for decoder TokenLogprobs, text offsets counted from `offset`
    (characters into the choice's text); returns the object and the offset after it."""
    tokens, offsets = [], []
    for entry in entries:
        tokens.append(entry.token)
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}, offset


def _echo_logprobs(echo: EchoedPrompt) -> dict:
    """The prompt's part of a choice's logprobs (the first token has no context: null)."""
    offsets, offset = [], 0
    for token in echo.tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": echo.tokens, "token_logprobs": [e.logprob if e else None for e in echo.entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} if e else None for e in echo.entries],
            "text_offset": offsets}


def _joined(echo: EchoedPrompt, generated: dict | None) -> dict:
    """The prompt's logprobs followed by the generated text's (its offsets moved past the prompt's text)."""
    out = _echo_logprobs(echo)
    if generated is not None:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] += generated[key]
        out["text_offset"] += [len(echo.text) + o for o in generated["text_offset"]]
    return out


def _refuse_unsupported(body: CompletionRequest) -> None:
    # Accepted for OpenAI compatibility only at their neutral values; anything else would be silently dropped.
    if body.echo and body.stream:
        raise InvalidArgument("echo is not supported with stream: ask for the whole answer", param="echo")
    if body.max_tokens == 0 and not body.echo:
        raise InvalidArgument("max_tokens 0 needs echo: true (the answer is then the prompt alone)",
                              param="max_tokens")
    if body.suffix:
        raise InvalidArgument("suffix (insertion) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidArgument("best_of is not supported (only best_of == n, which returns every choice)",
                              param="best_of")


@router.post("/v1/completions", tags=["generation"], responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request):
    """Continue a text or token-id prompt (or a list of them); whole, or streamed as server-sent events."""
    _refuse_unsupported(body)
    prompts = as_batch(body.prompt)
    if not prompts:
        raise InvalidArgument("prompt must not be empty", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidArgument(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    model = await catalog(request).resolve(body.model, GENERATION)
    rid = request_id(request)
    if body.echo:
        return await _echo(body, request, model, prompts, rid)
    sampling = body.sampling(body.max_tokens, body.logprobs)
    requests = [decoder_pb2.GenerateRequest(
        **model.target(), sampling=sampling, cache_salt=cache_salt(request, body.cache_salt),
        **({"text": p} if isinstance(p, str) else {"token_ids": decoder_pb2.TokenIds(ids=p)}))
        for p in prompts]
    generation = Generation(routing.route(request, model), requests, rid, body.n, body.error_fields())
    bill(request, generation.usage)
    await generation.start()
    head = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model.name}
    want_logprobs = body.logprobs is not None
    if body.stream:
        return sse.stream(generation, _chunks(generation, head, want_logprobs, body.include_usage), rid)
    choices = await sse.collect(request, generation)
    if not isinstance(choices, list):
        return choices
    return {**head, "choices": [{
        "index": i, "text": "".join(c.text), "finish_reason": c.finish_reason,
        "logprobs": _logprobs(c.logprobs, 0)[0] if want_logprobs else None,
    } for i, c in enumerate(choices)], "usage": generation.usage.to_json()}


async def _chunks(generation: Generation, head: dict, want_logprobs: bool, include_usage: bool):
    """text_completion chunks: one per delta that carries text, logprobs or a finish reason; then usage."""
    offsets = [0] * generation.num_choices
    extra = {"usage": None} if include_usage else {}
    async for index, delta in generation:
        reason = finish_reason(delta)
        if not (delta.text or reason or (want_logprobs and delta.logprobs)):
            continue  # tokens still held back (a possible stop string, an unfinished UTF-8 character)
        logprobs = None
        if want_logprobs:
            logprobs, offsets[index] = _logprobs(delta.logprobs, offsets[index])
        yield {**head, "choices": [{"index": index, "text": delta.text, "logprobs": logprobs,
                                    "finish_reason": reason}], **extra}
    if include_usage:
        yield {**head, "choices": [], "usage": generation.usage.to_json()}


async def _echo(body: CompletionRequest, request: Request, model, prompts: list, rid: str) -> dict:
    """An echo answer: each choice's text is its prompt, then what was generated (nothing with max_tokens 0)."""
    echoes = [await echoed(request, model, p, body.logprobs, rid) for p in prompts]
    head = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model.name}
    want_logprobs = body.logprobs is not None
    if body.max_tokens == 0:
        prompt_tokens = sum(len(e.ids) for e in echoes)
        return {**head, "choices": [{
            "index": i * body.n + j, "text": e.text, "finish_reason": "length",
            "logprobs": _echo_logprobs(e) if want_logprobs else None} for i, e in enumerate(echoes)
            for j in range(body.n)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens,
                      "prompt_tokens_details": {"cached_tokens": 0}}}
    sampling = body.sampling(body.max_tokens, body.logprobs)
    salt = cache_salt(request, body.cache_salt)
    requests = [decoder_pb2.GenerateRequest(**model.target(), sampling=sampling, cache_salt=salt,
                                            token_ids=decoder_pb2.TokenIds(ids=e.ids)) for e in echoes]
    generation = Generation(routing.route(request, model), requests, rid, body.n, body.error_fields())
    bill(request, generation.usage)
    await generation.start()
    choices = await sse.collect(request, generation)
    if not isinstance(choices, list):
        return choices
    return {**head, "choices": [{
        "index": i, "text": echoes[i // body.n].text + "".join(c.text), "finish_reason": c.finish_reason,
        "logprobs": _joined(echoes[i // body.n], _logprobs(c.logprobs, 0)[0]) if want_logprobs else None,
    } for i, c in enumerate(choices)], "usage": generation.usage.to_json()}
