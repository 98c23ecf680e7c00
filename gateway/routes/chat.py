"""POST /v1/chat/completions in OpenAI's shape, served by the decoder's Generate with the model's chat template.

Messages travel as role + content parts (plus an assistant's tool_calls and a tool message's
tool_call_id); the decoder renders its own template (with the generation prompt and the tools) and
judges roles and content: which role may carry tool_calls or tool_call_id, that content is present, that a
tool message answers an earlier call are its rulebook's (services/decoder/server/validation.py), so
this module checks JSON shape only. Tool calling (tools, tool_choice, parallel_tool_calls) is planned by
gateway/tools.py and each choice's text is read back into calls by gateway/tool_calls.py.
`image_url` parts must be inline data: URIs (nothing is ever fetched): gateway/images.py checks them
against the decoder's published limits,
sends the bytes to the vision service in one Encode call, and the decoder gets the rows, grids and hashes
as GenerateRequest.images, each part naming its image by ContentPart.image_index in message order.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import Field, ValidationError, model_validator

from services.common.errors import InvalidArgument, TesseraError, TooLarge
from services.common.pb import decoder_pb2

from .. import images as image_inputs
from .. import routing, sse
from ..backends import GENERATION, Model
from ..echo import vllm_prompt_logprobs
from ..errors import request_id
from ..generation import Generation, SamplingFields, finish_reason
from ..limits import bill
from ..structured_output import DECODER_PARAM
from ..tenants import cache_salt
from ..tool_calls import ChoiceToolCalls
from ..tools import Tool, ToolFields, ToolPlan
from .common import ERROR_RESPONSES, INT32_MAX, StrictBody, catalog

router = APIRouter()


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ImageURL(StrictBody):
    url: str = Field(description="a data: URI (base64 PNG, JPEG, WebP or GIF); http(s) URLs are refused,"
                                 " nothing is fetched")
    # The resolution comes from the checkpoint's preprocessor config; "low"/"high" would be silently ignored.
    detail: Literal["auto"] | None = Field(None, description="only auto: the model's preprocessor sets the size")


class ImagePart(StrictBody):
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(StrictBody):
    name: str
    arguments: str = Field(description="JSON text of an object, as the model's earlier answer gave it")


class ToolCall(StrictBody):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(StrictBody):
    """One message's JSON shape; which fields its role may carry is the decoder's rule (module docstring)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = Field(
        None, description="required, except on an assistant message with tool_calls")
    name: str | None = Field(None, description="the author's name, passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="assistant only: the calls it made")
    tool_call_id: str | None = Field(None, description="tool only (and required there): the call it answers")


class ChatRequest(ToolFields, SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="deprecated by OpenAI for"
                                                                         " max_completion_tokens; same meaning")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX,
                                              description="tokens to generate per choice; omitted: up to the"
                                                          " context length")
    logprobs: bool = Field(False, description="return each content token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX,
                                     description="alternatives per token (needs logprobs: true)")

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if None not in (self.max_tokens, self.max_completion_tokens) and \
                self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self


def as_chat(renamed: dict[str, str], **fields) -> ChatRequest:
    """A ChatRequest from another API's request (Responses, Messages), whose own model may bound a field more
    loosely than chat does: a value chat refuses is a 400 naming the caller's field (renamed: chat field ->
    theirs), not an error inside the gateway."""
    try:
        return ChatRequest(**fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "body"
        raise InvalidArgument(f"{renamed.get(field, field)}: {error['msg']}", param=renamed.get(field, field)) from None

def _image_refs(messages: list[Message]) -> list[image_inputs.ImageRef]:
    """Every image_url part, in message order: the order of GenerateRequest.images."""
    return [image_inputs.ImageRef(f"messages[{i}].content[{j}]", part.image_url.url)
            for i, message in enumerate(messages) if isinstance(message.content, list)
            for j, part in enumerate(message.content) if isinstance(part, ImagePart)]


def _parts(message: Message, first_image: int) -> list[decoder_pb2.ContentPart]:
    """The message's parts (none for null content); image parts name their image by index from first_image."""
    if message.content is None:
        return []
    if isinstance(message.content, str):
        return [decoder_pb2.ContentPart(text=message.content)]
    parts, index = [], first_image
    for part in message.content:
        if isinstance(part, ImagePart):
            parts.append(decoder_pb2.ContentPart(image_index=index))
            index += 1
        else:
            parts.append(decoder_pb2.ContentPart(text=part.text))
    return parts


def _to_proto(message: Message, first_image: int) -> decoder_pb2.ChatMessage:
    calls = [decoder_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
             for c in message.tool_calls or ()]
    return decoder_pb2.ChatMessage(role=message.role, content=_parts(message, first_image), name=message.name or "",
                                   tool_calls=calls, tool_call_id=message.tool_call_id or "")


def chat_messages(messages: list[Message], add_generation_prompt: bool = True,
                  tools: list[Tool] | None = None) -> decoder_pb2.ChatMessages:
    """The decoder's ChatMessages (a chat completion always asks for the generation prompt)."""
    out, images = [], 0
    for message in messages:
        out.append(_to_proto(message, images))
        images += sum(1 for p in out[-1].content if p.WhichOneof("kind") == "image_index")
    tools_json = json.dumps([t.to_json() for t in tools], ensure_ascii=False) if tools else ""
    return decoder_pb2.ChatMessages(messages=out, add_generation_prompt=add_generation_prompt, tools_json=tools_json)


async def _images(request: Request, refs: list[image_inputs.ImageRef], model, rid: str, salt: str
                  ) -> tuple[list[decoder_pb2.ImageInput], int]:
    """(The rows of the request's images, how many came from the vision cache), or a clear refusal before any
    vision work is wasted."""
    if not refs:
        return [], 0
    vision = next((b for b in request.app.state.backends if b.role == "vision"), None)
    image_inputs.check_urls(refs, model, vision)
    data = image_inputs.decode_uris(refs, model.limits.max_image_bytes)
    return await image_inputs.encode(vision, refs, data, rid, salt)


def _logprobs(entries) -> dict:
    """OpenAI's chat logprobs for decoder TokenLogprobs."""
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t.token, t.logprob) for t in e.top]}
                        for e in entries], "refusal": None}


@dataclass
class ChatRun:
    """A started chat generation: the model it runs on, its tool plan and the Generation to read or stream."""

    model: Model
    plan: ToolPlan
    generation: Generation
    request_id: str


async def start_chat(body: ChatRequest, request: Request, renamed: dict[str, str] | None = None,
                     include_stop: bool = False) -> ChatRun:
    """Start body on a decoder replica (refusals raise before any answer is sent). renamed: decoder param ->
    the field the caller sent, for an API that translates into a ChatRequest (gateway/routes/responses.py,
    messages.py); include_stop: the matched stop string ends the text (the caller reads and strips it)."""
    try:
        most = request.app.state.config.max_messages
        if most and len(body.messages) > most:   # the edge counted "role" keys; this counts what was parsed
            raise TooLarge(f"request has {len(body.messages)} messages, over the limit of {most} (max_messages)",
                           param="messages")
        model = await catalog(request).resolve(body.model, GENERATION)
        plan = body.tool_plan(model.name, model.extra.get("tool_call_parser"), body.constraint_field)
        chat = chat_messages(body.messages, tools=body.tools)
        rid = request_id(request)
        salt = cache_salt(request, body.cache_salt)   # the tenant's: its cache hits are its own
        images, cached_images = await _images(request, _image_refs(body.messages), model, rid, salt)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sampling = body.sampling(max_tokens, logprobs, body.prompt_logprobs)
        sampling.include_stop_str_in_output = include_stop
        plan.apply(sampling)
        generate = decoder_pb2.GenerateRequest(**model.target(), chat=chat, images=images, sampling=sampling,
                                               cache_salt=salt)
        # The decoder names its own fields; the caller should read the ones it sent.
        limit = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        fields = body.error_fields({"prompt": "messages", "images": "messages", "logprobs": "top_logprobs",
                                    "max_tokens": limit})
        if plan.schema is not None:
            fields[DECODER_PARAM] = "tools"    # a forced call's schema is the tools' parameters
        fields.update(renamed or {})
        generation = Generation(routing.route(request, model), [generate], rid, body.n, fields)
        bill(request, generation.usage)
        if images:
            generation.usage.images, generation.usage.cached_images = len(images), cached_images
        await generation.start()
    except TesseraError as err:
        # A refusal names the field the caller sent (the chat field, renamed).
        err.param = (renamed or {}).get(err.param, err.param)
        raise
    return ChatRun(model, plan, generation, rid)


@router.post("/v1/chat/completions", tags=["generation"], responses=ERROR_RESPONSES)
async def create_chat_completion(body: ChatRequest, request: Request):
    """Answer a conversation with the model's chat template; whole, or streamed as chat.completion.chunk events."""
    run = await start_chat(body, request)
    generation, plan, rid = run.generation, run.plan, run.request_id
    head = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
            "model": run.model.name}
    if body.stream:
        return sse.stream(generation, _chunks(generation, head, body.logprobs, body.include_usage, plan,
                                              _scores(body, generation)), rid)
    choices = await sse.collect(request, generation)
    if not isinstance(choices, list):
        return choices
    return {**head, "choices": [{"index": i, **_answer(c, plan), "logprobs": _logprobs(c.logprobs) if body.logprobs
                                 else None} for i, c in enumerate(choices)], "usage": generation.usage.to_json(),
            **_scores(body, generation)}


def _scores(body: ChatRequest, generation: Generation) -> dict:
    """vLLM's prompt_logprobs when asked: of the prompt every choice shares, from the first choice that reported
    it (start() awaited one)."""
    if body.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": vllm_prompt_logprobs(generation.prompts[min(generation.prompts)])
            if generation.prompts else None}


def _answer(choice, plan: ToolPlan) -> dict:
    """{"message", "finish_reason"} of one whole choice; with a tool parser, its calls read from the text."""
    text = "".join(choice.text)
    if plan.parser is None:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": choice.finish_reason}
    calls = ChoiceToolCalls(plan.parser())
    content, made = calls.whole(text)
    message = {"role": "assistant", "content": content or (None if made else "")}
    if made:
        message["tool_calls"] = made
    return {"message": message, "finish_reason": calls.finish_reason(choice.finish_reason)}


async def _chunks(generation: Generation, head: dict, want_logprobs: bool, include_usage: bool, plan: ToolPlan,
                  scores: dict):
    """chat.completion.chunk events: the role for every choice (the first also with `scores`, the prompt's
    logprobs when asked), content and tool-call deltas, a finish chunk per choice, then (include_usage) a last
    chunk with usage and no choices."""
    head = {**head, "object": "chat.completion.chunk", **({"usage": None} if include_usage else {})}
    calls = [ChoiceToolCalls(plan.parser()) for _ in range(generation.num_choices)] if plan.parser else None

    def chunk(index: int, delta: dict, logprobs=None, reason: str | None = None) -> dict:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": reason}]}

    for index in range(generation.num_choices):
        yield {**chunk(index, {"role": "assistant", "content": ""}), **(scores if index == 0 else {})}
    async for index, delta in generation:
        reason = finish_reason(delta)
        if calls is None:
            deltas = [{"content": delta.text}] if delta.text else []
        else:
            deltas = calls[index].feed(delta.text) + (calls[index].finish() if reason else [])
        logprobs = _logprobs(delta.logprobs) if want_logprobs else None
        if want_logprobs and delta.logprobs and not deltas:
            deltas = [{"content": ""}]     # text held back (a partial tag): the logprobs still go out now
        for k, piece in enumerate(deltas):
            yield chunk(index, piece, logprobs if k == 0 else None)
        if reason:
            yield chunk(index, {}, reason=calls[index].finish_reason(reason) if calls else reason)
    if include_usage:
        yield {**head, "choices": [], "usage": generation.usage.to_json()}
