"""POST /v1/messages and POST /v1/messages/count_tokens in Anthropic's Messages API shape, translated into a chat
request and answered by the chat path (gateway/routes/chat.py `start_chat`). Errors on these routes leave in
Anthropic's error shape (gateway/errors.py); the key may come as `x-api-key` (gateway/edge.py).

The translation: `system` (a string or text blocks) is a first system message; a user message's `tool_result`
blocks become tool messages (before the rest of its content), an assistant message's `tool_use` blocks its
tool_calls (the input as JSON text); `image` blocks with a base64 source are data: URLs as chat takes them (URL
sources are refused: nothing is fetched). `tools` (custom tools with an input_schema; server tools are refused,
naming their type) and `tool_choice` (auto, any -> required, tool -> a named function, none;
disable_parallel_tool_use -> parallel_tool_calls false) are chat's; `output_config.format` (a JSON schema) is
chat's response_format. `stop_sequences` are chat's stop strings,
asked back from the decoder at the end of the text so `stop_reason` can say `stop_sequence` and name it.

usage: `input_tokens` counts the prompt tokens not read from the prefix cache and `cache_read_input_tokens`
those that were (Anthropic's split; their sum is count_tokens' `input_tokens`). A stream's message_start has
them already (the decoder reports its prompt on the first message, which the gateway awaits before answering);
message_delta carries them again with output_tokens.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field, field_validator, model_validator

from services.common.errors import InvalidArgument, TesseraError
from services.common.pb import decoder_pb2

from .. import routing, sse
from ..backends import GENERATION
from ..counts import check_counts
from ..errors import anthropic_error, request_id
from ..generation import finish_reason
from ..message_blocks import MessageBlocks
from ..structured_output import JSONSchema, JSONSchemaFormat
from ..tool_calls import ChoiceToolCalls, chat_deltas
from ..tools import FUNCTION_NAME, FunctionDefinition, FunctionName, NamedToolChoice, Tool, check_parameters
from .chat import (
    ChatRequest,
    FunctionCall,
    ImagePart,
    ImageURL,
    Message,
    TextPart,
    ToolCall,
    as_chat,
    chat_messages,
    start_chat,
)
from .common import ERROR_RESPONSES, INT32_MAX, StrictBody, catalog

router = APIRouter()


class TextBlock(StrictBody):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="accepted: the prefix cache is automatic")


class Base64Source(StrictBody):
    type: Literal["base64"]
    media_type: Literal["image/png", "image/jpeg", "image/webp", "image/gif"]
    data: str


class URLSource(StrictBody):
    type: Literal["url"]
    url: str


class ImageBlock(StrictBody):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(StrictBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = Field(None, description="accepted; the result's text goes to the template as is")
    cache_control: dict[str, Any] | None = None


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(StrictBody):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class CustomTool(StrictBody):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, value):
        return check_parameters(value)


class ToolChoice(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="type tool only: the tool to call")
    disable_parallel_tool_use: bool | None = None


class JSONOutputFormat(StrictBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema the text must follow")


class OutputConfig(StrictBody):
    format: JSONOutputFormat | None = Field(None, description="structured output: enforced as chat's"
                                                              " response_format json_schema")
    effort: None = Field(None, description="refused: the served models have no effort setting")


class MessagesRequest(StrictBody):
    model: str | None = Field(None, description="a model from /v1/models; omitted: the served language model")
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    max_tokens: int = Field(ge=1, le=INT32_MAX, description="required, as Anthropic's")
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = Field(None, description="accepted (user_id); not used")
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    stream: bool = False

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, data):
        return check_counts(data, GENERATION)    # before anything is validated (gateway/counts.py)

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools(cls, value):
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"tools[{i}]: tool type {kind!r} is not supported (server tools run nowhere"
                                 f" here): only custom tools with an input_schema")
        return value


class CountTokensRequest(StrictBody):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, data):
        return check_counts(data, GENERATION)    # before anything is validated (gateway/counts.py)


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def _message(message: AnthropicMessage, i: int) -> list[Message]:
    """One Anthropic message as chat messages (module docstring)."""
    if isinstance(message.content, str):
        return [Message(role=message.role, content=message.content)]
    results, parts, calls = [], [], []
    for j, block in enumerate(message.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise InvalidArgument(f"{where}: tool_result blocks go in user messages", param="messages")
            results.append(Message(role="tool", content=_text(block.content), tool_call_id=block.tool_use_id))
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise InvalidArgument(f"{where}: tool_use blocks go in assistant messages", param="messages")
            calls.append(ToolCall(id=block.id, type="function", function=FunctionCall(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
        elif isinstance(block, ImageBlock):
            if isinstance(block.source, URLSource):
                raise InvalidArgument(f"{where}: URL image sources are refused (nothing is fetched); send the"
                                      f" image as a base64 source", param="messages")
            url = f"data:{block.source.media_type};base64,{block.source.data}"
            parts.append(ImagePart(type="image_url", image_url=ImageURL(url=url)))
        else:
            parts.append(TextPart(type="text", text=block.text))
    out = list(results)
    if calls:
        text = "".join(p.text for p in parts if isinstance(p, TextPart))
        out.append(Message(role="assistant", content=text or None, tool_calls=calls))
    elif parts:
        out.append(Message(role=message.role, content=parts))
    return out


def _conversation(body: MessagesRequest | CountTokensRequest) -> list[Message]:
    out = [] if body.system is None else [Message(role="system", content=_text(body.system))]
    for i, message in enumerate(body.messages):
        out += _message(message, i)
    return out


def _tools(body: MessagesRequest | CountTokensRequest) -> tuple[list[Tool] | None, Any, bool | None]:
    """(chat tools, chat tool_choice, parallel_tool_calls)."""
    tools = [Tool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.input_schema)) for t in body.tools or ()] or None
    choice = body.tool_choice
    if choice is None:
        return tools, None, None
    if choice.type == "tool" and not choice.name:
        raise InvalidArgument("tool_choice: type tool needs the tool's name", param="tool_choice")
    if tools is None:
        return None, None, None if choice.type in ("auto", "none") else _no_tools()
    chat_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or NamedToolChoice(
        type="function", function=FunctionName(name=choice.name))
    return tools, chat_choice, False if choice.disable_parallel_tool_use else None


def _no_tools():
    raise InvalidArgument("tool_choice any or tool needs tools", param="tool_choice")


def chat_request(body: MessagesRequest) -> ChatRequest:
    tools, choice, parallel = _tools(body)
    fmt = body.output_config.format if body.output_config is not None else None
    response_format = None if fmt is None else JSONSchemaFormat(type="json_schema", json_schema=JSONSchema(
        name="output", schema=fmt.schema_))
    return as_chat(RENAMED, model=body.model, messages=_conversation(body), max_completion_tokens=body.max_tokens,
                       temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences,
                       tools=tools, tool_choice=choice, parallel_tool_calls=parallel, response_format=response_format)


# Chat fields and decoder params -> the Messages field the caller sent.
RENAMED = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "stop": "stop_sequences",
           "prompt": "messages", "images": "messages", "response_format": "output_config"}


def _stop(text: str, reason: str | None, stops: list[str]) -> tuple[str, str | None]:
    """(text without the stop sequence that ended it, that sequence): the decoder was asked to keep it."""
    if reason == "stop":
        for s in sorted(stops, key=len, reverse=True):
            if text.endswith(s):
                return text[: len(text) - len(s)], s
    return text, None


def _stop_reason(reason: str | None, sequence: str | None, blocks: MessageBlocks) -> str:
    if reason == "length":
        return "max_tokens"
    if sequence is not None:
        return "stop_sequence"
    return "tool_use" if blocks.tool_used else "end_turn"


def _usage(usage) -> dict:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


@router.post("/v1/messages", tags=["generation"], responses=ERROR_RESPONSES)
async def create_message(body: MessagesRequest, request: Request):
    """Answer a conversation with the model's chat template; whole, or streamed as Anthropic's events."""
    run = await start_chat(chat_request(body), request, RENAMED, include_stop=bool(body.stop_sequences))
    head = {"id": f"msg_{run.request_id}", "type": "message", "role": "assistant", "model": run.model.name}
    if body.stream:
        return sse.stream(run.generation, _events(body, run, head), run.request_id, anthropic_error)
    choices = await sse.collect(request, run.generation)
    if not isinstance(choices, list):
        return choices
    choice = choices[0]
    text, sequence = _stop("".join(choice.text), choice.finish_reason, body.stop_sequences or [])
    blocks = MessageBlocks()
    calls = ChoiceToolCalls(run.plan.parser()) if run.plan.parser else None
    blocks.feed(chat_deltas(calls, text, True))
    blocks.close()
    return {**head, "content": blocks.content, "stop_reason": _stop_reason(choice.finish_reason, sequence, blocks),
            "stop_sequence": sequence, "usage": _usage(run.generation.usage)}


async def _events(body: MessagesRequest, run, head: dict):
    # The decoder's first message (awaited by start_chat) said how long the prompt was and what the cache held.
    prompt = run.generation.prompts.get(0)
    counts = {"input_tokens": prompt.prompt_tokens - prompt.cached_tokens, "output_tokens": 0,
              "cache_read_input_tokens": prompt.cached_tokens, "cache_creation_input_tokens": 0} \
        if prompt is not None else {"input_tokens": 0, "output_tokens": 0}
    yield {"type": "message_start", "message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                                "usage": counts}}
    yield {"type": "ping"}
    blocks = MessageBlocks()
    calls = ChoiceToolCalls(run.plan.parser()) if run.plan.parser else None
    reason = sequence = None
    async for _, delta in run.generation:
        reason = finish_reason(delta) or reason
        text = delta.text
        if reason is not None:
            text, sequence = _stop(text, reason, body.stop_sequences or [])
        for event in blocks.feed(chat_deltas(calls, text, reason is not None)):
            yield event
    for event in blocks.close():
        yield event
    yield {"type": "message_delta", "delta": {"stop_reason": _stop_reason(reason, sequence, blocks),
                                              "stop_sequence": sequence}, "usage": _usage(run.generation.usage)}
    yield {"type": "message_stop"}


@router.post("/v1/messages/count_tokens", tags=["tokens"], responses=ERROR_RESPONSES)
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    """The prompt tokens a message request with these fields would send (its usage's input_tokens plus
    cache_read_input_tokens)."""
    try:
        tools, _, _ = _tools(body)
        model = await catalog(request).resolve(body.model, GENERATION)
        chat = chat_messages(_conversation(body), tools=tools)
        backend = await routing.route(request, model).best()
        reply = await backend.call(backend.decoder.Tokenize, decoder_pb2.TokenizeRequest(
            **model.target(), chat=chat), request_id(request), {"prompt": "messages"})
    except TesseraError as err:
        err.param = RENAMED.get(err.param, err.param)
        raise
    return {"input_tokens": len(reply.token_ids)}
