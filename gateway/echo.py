"""The prompt's side of an answer, from the decoder's PromptInfo (a choice's first message): completions `echo`
with `logprobs` (what lm-evaluation-harness scores log-likelihoods by: `echo: true, logprobs: k, max_tokens: 0`)
and vLLM's `prompt_logprobs`.

The decoder scores every prompt token in the prompt's own forward (SamplingParams.prompt_logprobs), from the raw
model logits, before logit_bias and penalties. The first token has no context, so its logprob is null (OpenAI's
and vLLM's answer).
"""
from __future__ import annotations

from fastapi import Request

from services.common.pb import decoder_pb2

from . import routing
from .backends import Model


def scored(body) -> int | None:
    """The prompt_logprobs to ask the decoder for a completions body (its echo, logprobs, prompt_logprobs and
    max_tokens), or a chat body (prompt_logprobs alone); None: the prompt is not scored."""
    wants = [body.prompt_logprobs] if body.prompt_logprobs is not None else []
    if getattr(body, "echo", False):
        # max_tokens 0 generates nothing, which the decoder allows only for a scored prompt.
        wants.append(body.logprobs if body.logprobs is not None else 0 if body.max_tokens == 0 else None)
    wants = [w for w in wants if w is not None]
    return max(wants) if wants else None


def echo_logprobs(prompt: decoder_pb2.PromptInfo | None) -> dict:
    """The prompt's part of a completion choice's logprobs (OpenAI's shape; the first token's null)."""
    entries = list(prompt.logprobs) if prompt is not None else []
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob if i else None for i, e in enumerate(entries)],
            "top_logprobs": [{t.token: t.logprob for t in e.top} if i else None for i, e in enumerate(entries)],
            "text_offset": offsets}


def joined(prompt: decoder_pb2.PromptInfo | None, text: str, generated: dict | None) -> dict:
    """The prompt's logprobs followed by the generated text's (its offsets moved past the prompt's `text`)."""
    out = echo_logprobs(prompt)
    if generated is not None:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] += generated[key]
        out["text_offset"] += [len(text) + o for o in generated["text_offset"]]
    return out


def vllm_prompt_logprobs(prompt: decoder_pb2.PromptInfo | None) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token (the first null) a dict token id (a string, JSON's keys) ->
    {"logprob", "rank", "decoded_token"} holding the prompt token and its top alternatives (rank 1 the likeliest)."""
    if prompt is None or not prompt.logprobs:
        return None
    out: list[dict | None] = [None]
    for e in prompt.logprobs[1:]:
        entry = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}
        for rank, t in enumerate(e.top, start=1):
            entry.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank, "decoded_token": t.token})
        out.append(entry)
    return out


async def prompt_text(request: Request, model: Model, prompt: str | list[int], rid: str) -> str:
    """The text an echo starts with: the prompt itself, or a token-id prompt's detokenized text."""
    if isinstance(prompt, str):
        return prompt
    backend = await routing.route(request, model).best()
    return (await backend.call(backend.decoder.Detokenize, decoder_pb2.DetokenizeRequest(
        **model.target(), token_ids=prompt), rid, {"token_ids": "prompt"})).text
