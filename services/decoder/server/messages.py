"""ChatMessages (proto) -> the messages and tools the chat template renders, in the shapes HF templates read.

    messages: [{"role", "content": str | [part] | None, "name"?, "tool_calls"?, "tool_call_id"?}]
    tools:    OpenAI's list, [{"type": "function", "function": {"name", "description", "parameters"}}], or None

An assistant turn's tool_calls reach the template as [{"id", "type": "function", "function": {"name",
"arguments": {...}}}] with the arguments parsed from their JSON text: templates write them with `tojson`
(Qwen2.5's does), so a string would come out quoted twice. vLLM passes them the same way. A message with
tool calls and no parts has content None, as transformers' templates expect for a call-only turn.
"""
from __future__ import annotations

import json

from services.common.errors import InvalidArgument
from services.decoder.server.validation import check_messages


def _part(part) -> dict:
    if part.WhichOneof("kind") == "text":
        return {"type": "text", "text": part.text}
    return {"type": "image"}


def _arguments(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidArgument(f"{where}.function.arguments is not valid JSON: {text[:80]!r}",
                              param="messages") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}.function.arguments must be a JSON object, got {type(value).__name__}",
                              param="messages")
    return value


def template_messages(chat) -> list[dict]:
    """The template's messages for a decoder_pb2.ChatMessages.

    Raises InvalidArgument (param messages): what the rulebook's check_messages refuses (roles, tool calls;
    services/decoder/server/validation.py), call arguments that are not a JSON object.
    """
    check_messages(chat)
    out = []
    for i, m in enumerate(chat.messages):
        where = f"messages[{i}]"
        message = {"role": m.role,
                   "content": None if m.tool_calls and not m.content else [_part(p) for p in m.content]}
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": _arguments(c.arguments, f"{where}.tool_calls[{j}]")}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def template_tools(chat) -> list[dict] | None:
    """The tools list of a ChatMessages, or None without one. Raises InvalidArgument (param tools)."""
    if not chat.tools_json:
        return None
    try:
        tools = json.loads(chat.tools_json)
    except (ValueError, RecursionError):
        raise InvalidArgument("tools is not valid JSON", param="tools") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidArgument("tools must be a JSON list of objects", param="tools")
    return tools
