"""An Anthropic Messages answer's content blocks, built from one choice's chat deltas (gateway/tool_calls.py), and
the stream events that build them: content_block_start, content_block_delta (text_delta, input_json_delta),
content_block_stop. A whole answer is the same builder fed the whole text, so streamed and whole agree.

Text becomes a `text` block once there is some; a tool call closes the open block and opens a `tool_use` block
whose input streams as the JSON text the parser reads (parsed into `input` when the block closes). An answer with
no text and no call is one empty text block, as Anthropic answers.
"""
from __future__ import annotations

import json
import uuid


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class MessageBlocks:
    """Feed chat deltas (`feed`), then `close`; each returns the stream events and `content` holds the blocks.
    Calls keep the chat call ids (`call_…`), so a tool_result names the id the answer gave."""

    def __init__(self):
        self.content: list[dict] = []
        self._open: int | None = None
        self._json: dict[int, str] = {}      # content index of a tool_use block -> its input's JSON text so far
        self._calls: dict[int, int] = {}     # tool call index -> content index

    def feed(self, deltas: list[dict]) -> list[dict]:
        events: list[dict] = []
        for delta in deltas:
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    events += self._tool_use(call["index"], call["id"], call["function"]["name"])
                if call["function"].get("arguments"):
                    at = self._calls[call["index"]]
                    self._json[at] += call["function"]["arguments"]
                    events.append({"type": "content_block_delta", "index": at, "delta": {
                        "type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
        return events

    def close(self) -> list[dict]:
        events = [] if self.content else self._start({"type": "text", "text": ""})
        return events + self._stop()

    @property
    def tool_used(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.content)

    def _text(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self.content[self._open]["type"] != "text":
            events += self._stop() + self._start({"type": "text", "text": ""})
        self.content[self._open]["text"] += text
        return events + [{"type": "content_block_delta", "index": self._open,
                          "delta": {"type": "text_delta", "text": text}}]

    def _tool_use(self, index: int, call_id: str, name: str) -> list[dict]:
        events = self._stop() + self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}})
        self._calls[index] = self._open
        self._json[self._open] = ""
        return events

    def _start(self, block: dict) -> list[dict]:
        self._open = len(self.content)
        self.content.append(block)
        return [{"type": "content_block_start", "index": self._open, "content_block": dict(block)}]

    def _stop(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        block = self.content[index]
        if block["type"] == "tool_use":
            text = self._json[index]
            try:
                block["input"] = json.loads(text) if text else {}
            except json.JSONDecodeError:
                # Cut by max_tokens mid-call: Anthropic's input is an object, so the partial text is kept whole.
                block["input"] = {"_partial_json": text}
        return [{"type": "content_block_stop", "index": index}]
