"""POST /tokenize and POST /detokenize in vLLM's shapes, served by the decoder's Tokenize and Detokenize.

Routed by `model` as generation is: an adapter's name goes to the decoder serving its base model
(an adapter tokenizes as its base; the decoder checks that the adapter is registered).

/tokenize takes one of two forms:
- prompt: {model, prompt, add_special_tokens (default true), return_token_strs};
- chat: {model, messages, add_generation_prompt (default true), add_special_tokens (default false),
  return_token_strs}: with the defaults, exactly the ids /v1/chat/completions prompts the model with.
  `tools` (checked as chat completions check them) are rendered by the template as a chat completion
  with those tools renders them, so the count is that request's prompt length.
Refused with a 400 rather than answered wrong: image parts (an image's length is its grid, known only
once the vision service encoded it).
The answer is {count, max_model_len, tokens, token_strs}; token_strs (the vocabulary's spelling of each
id) is null unless return_token_strs is true, as in vLLM.

/detokenize: {model, tokens} -> {prompt}, special tokens kept (vLLM's decode).
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import Field

from services.common.errors import InvalidArgument
from services.common.pb import decoder_pb2

from .. import routing
from ..backends import GENERATION
from ..errors import request_id
from ..tools import Tool
from .chat import ImagePart, Message, chat_messages
from .common import ERROR_RESPONSES, INT64_MAX, INT64_MIN, StrictBody, catalog

router = APIRouter()


class TokenizeRequest(StrictBody):
    model: str | None = Field(None, description="a generation model or adapter; omitted: the served language model")
    prompt: str | None = Field(None, description="text to tokenize (the prompt form)")
    messages: list[Message] | None = Field(None, min_length=1, description="a conversation (the chat form),"
                                                                           " text parts only")
    add_special_tokens: bool | None = Field(None, description="run the tokenizer's post-processor (e.g. BOS);"
                                                              " default true for prompt, false for messages")
    add_generation_prompt: bool | None = Field(None, description="chat form only; default true")
    return_token_strs: bool = Field(False, description="also return each id's vocabulary entry")
    tools: list[Tool] | None = Field(None, min_length=1, description="chat form only: the tools a chat"
                                                                     " completion would send")


class DetokenizeRequest(StrictBody):
    model: str | None = Field(None, description="a generation model or adapter; omitted: the served language model")
    tokens: list[Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]]


def _tokenize_request(body: TokenizeRequest, target: dict[str, str]) -> decoder_pb2.TokenizeRequest:
    """The decoder's request for a checked body (one of prompt / messages)."""
    if body.messages is None:
        return decoder_pb2.TokenizeRequest(**target, text=body.prompt, return_token_strs=body.return_token_strs,
                                           add_special_tokens=body.add_special_tokens is not False)
    chat = chat_messages(body.messages, add_generation_prompt=body.add_generation_prompt is not False,
                         tools=body.tools)
    return decoder_pb2.TokenizeRequest(**target, chat=chat, return_token_strs=body.return_token_strs,
                                       add_special_tokens=bool(body.add_special_tokens))


def _check(body: TokenizeRequest) -> None:
    if body.prompt is None and body.messages is None:
        raise InvalidArgument("send prompt (text) or messages (a conversation)", param="prompt")
    if body.prompt is not None and body.messages is not None:
        raise InvalidArgument("send either prompt or messages, not both", param="messages")
    if body.messages is None and body.tools is not None:
        raise InvalidArgument("tools need messages (the chat form)", param="tools")
    if body.messages is None and body.add_generation_prompt is not None:
        raise InvalidArgument("add_generation_prompt needs messages (the chat form)", param="add_generation_prompt")
    for i, message in enumerate(body.messages or ()):
        if isinstance(message.content, list) and any(isinstance(p, ImagePart) for p in message.content):
            raise InvalidArgument(f"messages[{i}]: image parts cannot be tokenized (their token count is the"
                                  " image's grid, known only once it is encoded); send text parts only",
                                  param="messages")


@router.post("/tokenize", tags=["tokens"], responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """Token ids of a prompt or of a conversation rendered with the model's chat template."""
    _check(body)
    model = await catalog(request).resolve(body.model, GENERATION)
    backend = await routing.route(request, model).best()
    reply = await backend.call(backend.decoder.Tokenize, _tokenize_request(body, model.target()), request_id(request))
    return {"count": len(reply.token_ids), "max_model_len": reply.max_model_len, "tokens": list(reply.token_ids),
            "token_strs": list(reply.token_strs) if body.return_token_strs else None}


@router.post("/detokenize", tags=["tokens"], responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    """The text of token ids, special tokens kept."""
    model = await catalog(request).resolve(body.model, GENERATION)
    backend = await routing.route(request, model).best()
    reply = await backend.call(backend.decoder.Detokenize,
                               decoder_pb2.DetokenizeRequest(**model.target(), token_ids=body.tokens),
                               request_id(request), {"token_ids": "tokens"})
    return {"prompt": reply.text}
