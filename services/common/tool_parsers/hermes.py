"""The hermes format (NousResearch Hermes 2/3, Qwen2.5, Qwen3): each call is a tagged JSON object.

    I'll look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>

- Text outside the tags is content, streamed as it arrives; only a tail that may still become `<tool_call>`
  (`<`, `<tool_`, ...) is held back, so a partial tag never reaches the client.
- A block becomes a call when its body is a JSON object with a non-empty string `name` and an object
  `arguments` (absent: `{}`); the arguments are re-serialised (`json.dumps`, non-ASCII kept), as vLLM does.
  The block is judged whole, at its `</tool_call>`, so a call is sent only once it is known to parse.
- A block that is not such an object stays content, verbatim, tags included. vLLM turns the *whole* output
  into content when any block fails; judging each block on its own keeps the calls that did parse and lets a
  streamed answer (which has sent earlier calls already) equal the whole one.
- A block still open when the choice ends (a stop string, EOS or parallel_tool_calls false cut its
  `</tool_call>`) is judged the same way, as vLLM reads an unclosed last tag.
- Whitespace between text and a call, between calls and after the last one only separates them, and is
  dropped; a choice without calls keeps its text exactly.
"""
from __future__ import annotations

import json

from .parser import CallArguments, CallName, Content, Event, ToolCallParser

START, END = "<tool_call>", "</tool_call>"


def _held(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag (it may still become the tag)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's body, or None when it is not a call."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class HermesParser(ToolCallParser):
    name = "hermes"
    about = "Qwen2.5, Qwen3, Hermes 2/3: <tool_call>{json}</tool_call>"
    call_end = END

    def __init__(self):
        self._buf = ""            # text not yet classified: a possible partial tag
        self._in_call = False
        self._body = ""           # the open block's text so far
        self._ws = ""             # trailing whitespace of the content sent, held until text follows
        self._after_call = False  # whitespace right after a call is a separator
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._buf += text
        while True:
            tag = END if self._in_call else START
            at = self._buf.find(tag)
            if at < 0:
                keep = _held(self._buf, tag)
                ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                if self._in_call:
                    self._body += ready
                else:
                    self._content(ready, events)
                return events
            before, self._buf = self._buf[:at], self._buf[at + len(tag):]
            if self._in_call:
                self._body += before
                self._close(events, closed=True)
            else:
                self._content(before, events)
                self._in_call, self._body = True, ""

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._in_call:
            self._body += self._buf
            self._close(events, closed=False)
        else:
            self._content(self._buf, events)   # a partial tag at the very end is text after all
        self._buf = ""
        if self._ws and not self._calls:
            events.append(Content(self._ws))
        self._ws = ""
        return events

    def _content(self, text: str, events: list[Event]) -> None:
        if self._after_call:
            text = text.lstrip()
        if not text:
            return
        self._after_call = False
        kept = text.rstrip()
        if not kept:
            self._ws += text
            return
        events.append(Content(self._ws + kept))
        self._ws = text[len(kept):]

    def _close(self, events: list[Event], closed: bool) -> None:
        self._in_call = False
        call = _call(self._body)
        if call is None:
            self._content(START + self._body + (END if closed else ""), events)
            return
        name, arguments = call
        self._ws = ""   # it only separated the text before from this call
        events += [CallName(self._calls, name), CallArguments(self._calls, arguments)]
        self._calls += 1
        self._after_call = True
