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
from ..echo import echo_logprobs, joined, prompt_text, scored, vllm_prompt_logprobs
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
                                               " null: up to the context length; 0 only with echo or"
                                               " prompt_logprobs (the prompt alone, as harnesses score it)")
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX,
                                 description="return each token's logprob and this many top alternatives")
    echo: bool = Field(False, description="the answer starts with the prompt; with logprobs, the prompt's tokens"
                                          " carry theirs (the first one's null), scored in the prompt's own"
                                          " forward (such a prompt is not served from the prefix cache)")
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


def _refuse_unsupported(body: CompletionRequest) -> None:
    # Accepted for OpenAI compatibility only at their neutral values; anything else would be silently dropped.
    if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
        raise InvalidArgument("max_tokens 0 needs echo: true or prompt_logprobs (the answer is then the prompt"
                              " alone)", param="max_tokens")
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
    texts = [await prompt_text(request, model, p, rid) for p in prompts] if body.echo else None
    sampling = body.sampling(body.max_tokens, body.logprobs, scored(body))
    requests = [decoder_pb2.GenerateRequest(
        **model.target(), sampling=sampling, cache_salt=cache_salt(request, body.cache_salt),
        **({"text": p} if isinstance(p, str) else {"token_ids": decoder_pb2.TokenIds(ids=p)}))
        for p in prompts]
    generation = Generation(routing.route(request, model), requests, rid, body.n, body.error_fields())
    bill(request, generation.usage)
    await generation.start()
    head = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model.name}
    if body.stream:
        return sse.stream(generation, _chunks(generation, head, body, texts), rid)
    choices = await sse.collect(request, generation)
    if not isinstance(choices, list):
        return choices
    return {**head, "choices": [_choice(body, i, c, generation.prompts.get(i), texts)
                                for i, c in enumerate(choices)], "usage": generation.usage.to_json()}


def _choice(body: CompletionRequest, i: int, c, prompt, texts: list[str] | None) -> dict:
    """Whole choice i: its text (after the echoed prompt), logprobs, and vLLM's prompt_logprobs when asked."""
    generated = _logprobs(c.logprobs, 0)[0] if body.logprobs is not None else None
    echo = texts[i // body.n] if texts is not None else ""
    logprobs = joined(prompt, echo, generated) if texts is not None and generated is not None else generated
    out = {"index": i, "text": echo + "".join(c.text), "finish_reason": c.finish_reason, "logprobs": logprobs}
    if body.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(prompt)
    return out


async def _chunks(generation: Generation, head: dict, body: CompletionRequest, texts: list[str] | None):
    """text_completion chunks: one per delta that carries text, logprobs or a finish reason; then usage. A choice's
    first chunk starts with its echoed prompt (and its logprobs) and carries prompt_logprobs when asked."""
    want_logprobs = body.logprobs is not None
    offsets = [0] * generation.num_choices
    extra = {"usage": None} if body.include_usage else {}
    started: set[int] = set()
    async for index, delta in generation:
        reason = finish_reason(delta)
        text, prompt_part, first = delta.text, None, {}
        if index not in started:
            started.add(index)
            prompt = generation.prompts.get(index)
            if texts is not None:
                text = texts[index // body.n] + text
                offsets[index] = len(texts[index // body.n])
                prompt_part = echo_logprobs(prompt)
            if body.prompt_logprobs is not None:
                first["prompt_logprobs"] = vllm_prompt_logprobs(prompt)
        if not (text or reason or first or (want_logprobs and delta.logprobs)):
            continue  # tokens still held back (a possible stop string, an unfinished UTF-8 character)
        logprobs = None
        if want_logprobs:
            logprobs, offsets[index] = _logprobs(delta.logprobs, offsets[index])
            if prompt_part is not None:
                logprobs = {key: prompt_part[key] + logprobs[key] for key in logprobs}
        yield {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                                    **first}], **extra}
    if body.include_usage:
        yield {**head, "choices": [], "usage": generation.usage.to_json()}
