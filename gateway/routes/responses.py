"""POST /v1/responses in OpenAI's Responses API shape, translated into a chat request and answered by the chat
path (gateway/routes/chat.py `start_chat`): one template, one tool planner, one structured-output path.

The translation: `instructions` is a first system message; `input` a string (one user message) or items:
`message` (roles user, assistant, system, developer; developer becomes system, as templates know no developer
role) with input_text / input_image (data: URLs only, as chat) / output_text parts, `function_call` (an
assistant message's tool_calls; consecutive calls are one message) and `function_call_output` (a tool
message). Function tools become chat tools, `tool_choice` its chat form, `text.format` the chat
response_format. The output items and their stream events are gateway/response_items.py's.

With --response-store (gateway/response_store.py), `store` (default true, as OpenAI's) keeps the response and
its whole conversation per tenant, `previous_response_id` continues one (its items first, function calls and
outputs included; the unchanged prefix makes the new prompt a prefix-cache hit), and GET / DELETE
/v1/responses/{id} read and remove one. Without it, `store: true` and `previous_response_id` are 400s. Refused
too, each a 400 naming the field rather than silently ignored: `background`, `prompt`, `conversation`,
`reasoning` and `truncation: "auto"`.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from services.common.errors import InvalidArgument, TesseraError

from .. import sse
from ..backends import GENERATION
from ..counts import check_counts
from ..generation import UINT64_MAX, finish_reason
from ..response_items import ResponseItems
from ..structured_output import JSONObjectFormat, JSONSchema, JSONSchemaFormat, TextFormat
from ..tool_calls import ChoiceToolCalls, chat_deltas
from ..tools import FUNCTION_NAME, FunctionDefinition, FunctionName, NamedToolChoice, Tool, check_parameters
from . import stored_responses
from .chat import ChatRequest, FunctionCall, ImagePart, ImageURL, Message, TextPart, ToolCall, as_chat, start_chat
from .common import ERROR_RESPONSES, INT32_MAX, StrictBody

router = APIRouter()

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Fields of OpenAI's Responses API that tessera cannot honour -> why (a 400 naming the field).
REFUSED = {"background": "background runs are not supported: the answer comes on this connection",
           "prompt": "stored prompt templates are not supported: send instructions and input",
           "conversation": "conversations are not kept: send previous_response_id or the earlier items in input",
           "reasoning": "reasoning settings are not supported by the served models"}


class InputText(StrictBody):
    type: Literal["input_text"]
    text: str


class InputImage(StrictBody):
    type: Literal["input_image"]
    image_url: str = Field(description="a data: URI; http(s) URLs are refused, nothing is fetched")
    detail: Literal["auto"] | None = Field(None, description="only auto: the model's preprocessor sets the size")


class OutputText(StrictBody):
    """An earlier answer's text, as a client sends a previous output back in input."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


Part = Annotated[InputText | InputImage | OutputText, Field(discriminator="type")]


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON text of an object, as the earlier answer gave it")
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _item_kind(value) -> str:
    return value.get("type", "message") if isinstance(value, dict) else "message"


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_kind)]


# A stored conversation read back (gateway/routes/stored_responses.py), checked as input is.
ITEMS = TypeAdapter(list[Item])


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="true is enforced under tool_choice required or a named"
                                                  " function; under auto it is refused")

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value):
        return value if value is None else check_parameters(value)


class FunctionChoice(StrictBody):
    type: Literal["function"]
    name: str


class FlatJSONSchema(StrictBody):
    """The Responses API's json_schema format: the chat form's json_schema fields, flattened."""

    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictBody):
    format: Annotated[TextFormat | JSONObjectFormat | FlatJSONSchema, Field(discriminator="type")] | None = None


def _refused(name: str):
    return Field(None, description=f"refused: {REFUSED[name]}")


class ResponsesRequest(StrictBody):
    model: str | None = Field(None, description="a model from /v1/models; omitted: the served language model")
    input: str | list[Item] = Field(description="a user message, or a list of items")
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = Field(None, min_length=1, description="function tools only")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    store: bool | None = Field(None, description="keep the response for previous_response_id and GET (default"
                                                 " true with --response-store; without it only false)")
    previous_response_id: str | None = Field(None, description="continue this stored response: its"
                                                               " conversation comes before input")
    metadata: dict[str, str] | None = Field(None, description="echoed in the response; at most 16 pairs")
    user: str | None = None
    truncation: Literal["disabled"] | None = Field(None, description="only disabled: a prompt over the context"
                                                                      " length is refused, never cut")
    service_tier: Literal["auto", "default"] | None = None
    # Our sampling extras, as chat takes them.
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    background: SkipJsonSchema[Any] = _refused("background")
    prompt: SkipJsonSchema[Any] = _refused("prompt")
    conversation: SkipJsonSchema[Any] = _refused("conversation")
    reasoning: SkipJsonSchema[Any] = _refused("reasoning")

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, data):
        return check_counts(data, GENERATION)    # before anything is validated (gateway/counts.py)

    @field_validator(*REFUSED, mode="before")
    @classmethod
    def _refuse(cls, value, info: ValidationInfo):
        if value is None or (info.field_name == "background" and value is False):
            return None
        raise ValueError(REFUSED[info.field_name])

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value):
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}]: tool type {kind!r} is not supported (built-in tools run nowhere"
                                 f" here): only function tools")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value):
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys up to 64 and values up to 512 characters")
        return value

    @property
    def want_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


def _parts(content: str | list, role: str, where: str) -> str | list:
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if isinstance(part, InputImage):
            if role != "user":
                raise InvalidArgument(f"{where}.content[{j}]: images go in user messages", param="input")
            out.append(ImagePart(type="image_url", image_url=ImageURL(url=part.image_url, detail=part.detail)))
        else:
            out.append(TextPart(type="text", text=part.text))
    return out


def input_items(body: ResponsesRequest) -> list:
    return [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else list(body.input)


def chat_messages(body: ResponsesRequest, items: list) -> list[Message]:
    """The conversation the chat path answers (module docstring): instructions, then items."""
    messages = [Message(role="system", content=body.instructions)] if body.instructions is not None else []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(Message(role=role, content=_parts(item.content, item.role, f"input[{i}]")))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, type="function",
                            function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and (last.tool_calls or last.content in (None, "")):
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                messages.append(Message(role="assistant", tool_calls=[call]))
        else:
            messages.append(Message(role="tool", content=item.output, tool_call_id=item.call_id))
    if not messages:
        raise InvalidArgument("input has no items", param="input")
    return messages


def chat_request(body: ResponsesRequest, items: list) -> ChatRequest:
    """body as a ChatRequest (the fields the two share, under their chat names), answering items."""
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, FlatJSONSchema):
        fmt = JSONSchemaFormat(type="json_schema", json_schema=JSONSchema(
            name=fmt.name, schema=fmt.schema_, description=fmt.description, strict=fmt.strict))
    tools = [Tool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in body.tools or ()]
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    return as_chat(RENAMED,
        model=body.model, messages=chat_messages(body, items), max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, tools=tools or None, tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls, response_format=fmt, logprobs=body.want_logprobs,
        top_logprobs=body.top_logprobs if body.want_logprobs else None, seed=body.seed, stop=body.stop,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, top_k=body.top_k,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos)


# Chat fields and decoder params -> the Responses field the caller sent.
RENAMED = {"messages": "input", "prompt": "input", "images": "input", "response_format": "text",
           "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "logprobs": "top_logprobs"}


def _usage(usage) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _response(body: ResponsesRequest, response_id: str, model: str, created: int, status: str, output: list,
              usage=None, stored: bool = False) -> dict:
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
        else {"type": "text"}
    return {"id": response_id, "object": "response", "created_at": created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": None, "store": stored,
            "temperature": body.temperature,
            "text": {"format": fmt}, "tool_choice": body.tool_choice.model_dump() if isinstance(
                body.tool_choice, FunctionChoice) else body.tool_choice or ("auto" if body.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()], "top_p": body.top_p,
            "truncation": "disabled", "usage": _usage(usage) if usage is not None else None,
            "user": body.user, "metadata": body.metadata or {}}


def _status(reason: str | None) -> str:
    return "incomplete" if reason == "length" else "completed"


@router.post("/v1/responses", tags=["generation"], responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request):
    """Answer input items with the model's chat template; whole, or streamed as typed response.* events."""
    store = await stored_responses.store_for(request, body.store)
    earlier = ITEMS.validate_python(await stored_responses.earlier_items(request, body.previous_response_id))
    items = earlier + input_items(body)
    chat = chat_request(body, items)
    if body.want_logprobs and body.tools and body.tool_choice != "none":
        raise InvalidArgument(f"include {LOGPROBS_INCLUDE} cannot be combined with tool calls (the call text"
                              f" has no output_text to carry them)", param="include")
    run = await start_chat(chat, request, RENAMED)
    created = int(time.time())
    # Random, not the request id (a caller may choose that): stored responses are looked up by it.
    response_id = f"resp_{uuid.uuid4().hex}"
    keep = Keep(store, request, items)
    if body.stream:
        numbered = Numbered()
        return sse.stream(run.generation, _events(body, run, response_id, created, keep, numbered),
                          run.request_id, numbered.error)
    choices = await sse.collect(request, run.generation)
    if not isinstance(choices, list):
        return choices
    choice = choices[0]
    built = ResponseItems(body.want_logprobs)
    calls = ChoiceToolCalls(run.plan.parser()) if run.plan.parser else None
    built.feed(chat_deltas(calls, "".join(choice.text), True), choice.logprobs)
    built.close(choice.finish_reason != "length")
    answer = _response(body, response_id, run.model.name, created, _status(choice.finish_reason),
                       built.output, run.generation.usage, store is not None)
    await keep(answer)
    return answer


class Keep:
    """Stores an answer with its conversation (items, then its output), when the request asked to."""

    def __init__(self, store, request: Request, items: list):
        self.store, self._request = store, request
        self._items = [i.model_dump(by_alias=True, exclude_none=True) for i in items]

    async def __call__(self, answer: dict) -> None:
        if self.store is not None:
            await stored_responses.keep(self._request, self.store, answer, [*self._items, *answer["output"]])


class Numbered:
    """Numbers a stream's events (sequence_number from 0), a failure's error event included."""

    def __init__(self):
        self.next = 0

    def __call__(self, event: dict) -> dict:
        event["sequence_number"] = self.next
        self.next += 1
        return event

    def error(self, err: TesseraError, rid: str) -> dict:
        return self({"type": "error", "code": err.code or err.reason.lower(), "message": err.message,
                     "param": err.param})


async def _events(body: ResponsesRequest, run, response_id: str, created: int, keep: Keep, numbered: Numbered):
    """The typed events of one streamed response, numbered by sequence_number."""
    head = _response(body, response_id, run.model.name, created, "in_progress", [],
                     stored=keep.store is not None)
    yield numbered({"type": "response.created", "response": head})
    yield numbered({"type": "response.in_progress", "response": head})
    items = ResponseItems(body.want_logprobs)
    calls = ChoiceToolCalls(run.plan.parser()) if run.plan.parser else None
    reason = None
    async for _, delta in run.generation:
        reason = finish_reason(delta) or reason
        for event in items.feed(chat_deltas(calls, delta.text, reason is not None), delta.logprobs):
            yield numbered(event)
    for event in items.close(reason != "length"):
        yield numbered(event)
    status = _status(reason)
    done = _response(body, response_id, run.model.name, created, status, items.output, run.generation.usage,
                     keep.store is not None)
    await keep(done)
    yield numbered({"type": f"response.{status}", "response": done})

