"""One choice's answer in OpenAI's tool-call shape, from a ToolCallParser's events.

Streamed, each text delta becomes a list of chat deltas, in order:

    {"content": "Let me check."}
    {"tool_calls": [{"index": 0, "id": "call_…", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": "}}]}

Whole, the same events give `content` and `tool_calls: [{"id", "type": "function", "function": {"name",
"arguments"}}]`, so the two always agree (up to the random call ids). A choice that called tools and ended
on its own finishes with "tool_calls"; one cut by max_tokens stays "length".
"""
from __future__ import annotations

import uuid

from services.common.tool_parsers import CallArguments, CallName, Content, Event, ToolCallParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceToolCalls:
    """Feed one choice's text deltas, get its chat deltas; `calls` holds the whole calls so far."""

    def __init__(self, parser: ToolCallParser):
        self._parser = parser
        self.calls: list[dict] = []

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self._parser.feed(text)) if text else []

    def finish(self) -> list[dict]:
        return self._deltas(self._parser.finish())

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def whole(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls) of a whole choice's text."""
        deltas = self.feed(text) + self.finish()
        return "".join(d.get("content", "") for d in deltas), self.calls

    def _deltas(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if isinstance(event, Content):
                if out and "content" in out[-1]:
                    out[-1]["content"] += event.text
                else:
                    out.append({"content": event.text})
            elif isinstance(event, CallName):
                call = {"id": call_id(), "type": "function", "function": {"name": event.name, "arguments": ""}}
                self.calls.append(call)
                out.append({"tool_calls": [{"index": event.index, **call,
                                            "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, CallArguments) and event.text:
                self.calls[event.index]["function"]["arguments"] += event.text
                out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        return out


def chat_deltas(calls: ChoiceToolCalls | None, text: str, final: bool) -> list[dict]:
    """One decoder delta's text as chat deltas: plain content without a parser (calls None), else the parser's
    reading of it; final: the choice ended, so the parser releases what it held."""
    if calls is None:
        return [{"content": text}] if text else []
    return calls.feed(text) + (calls.finish() if final else [])
