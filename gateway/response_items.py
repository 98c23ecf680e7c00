"""A Responses API answer's output items, built from one choice's chat deltas (gateway/tool_calls.py), and the
typed stream events that build them, in OpenAI's order:

    response.output_item.added (message) -> response.content_part.added -> response.output_text.delta ...
    -> response.output_text.done -> response.content_part.done -> response.output_item.done
    response.output_item.added (function_call) -> response.function_call_arguments.delta ...
    -> response.function_call_arguments.done -> response.output_item.done

A whole answer is the same builder fed the whole text at once, so streamed and whole output always agree (up
to the random item ids). Text becomes a `message` item only once there is some; a tool call closes the open
item and opens a `function_call` item whose arguments stream as the parser reads them, so tool-call text never
reaches an output_text delta. An answer with no text and no call is one empty message.
"""
from __future__ import annotations

import uuid


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def logprobs_json(entries) -> list[dict]:
    """OpenAI's output_text logprobs for decoder TokenLogprobs."""
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return [{**one(e.token, e.logprob), "top_logprobs": [one(t.token, t.logprob) for t in e.top]} for e in entries]


class ResponseItems:
    """Feed chat deltas (`feed`), then `close`; each returns the stream events (without sequence_number) and
    `output` holds the items so far. want_logprobs: output_text parts carry their tokens' logprobs."""

    def __init__(self, want_logprobs: bool = False):
        self.output: list[dict] = []
        self._want_logprobs = want_logprobs
        self._open: int | None = None          # the output index of the item being written
        self._calls: dict[int, int] = {}       # tool call index -> output index

    def feed(self, deltas: list[dict], logprobs=()) -> list[dict]:
        events: list[dict] = []
        logprobs = logprobs_json(logprobs) if self._want_logprobs else []
        for delta in deltas:
            if delta.get("content"):
                events += self._text(delta["content"], logprobs)
                logprobs = []
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    events += self._call(call["index"], call["id"], call["function"]["name"])
                if call["function"].get("arguments"):
                    events += self._arguments(call["index"], call["function"]["arguments"])
        if logprobs and self._open is not None and self.output[self._open]["type"] == "message":
            # Tokens whose text is held back (a partial stop string or tag) still report their logprobs.
            self.output[self._open]["content"][0]["logprobs"].extend(logprobs)
        return events

    def close(self, complete: bool = True) -> list[dict]:
        """End the answer: the open item is done (incomplete when cut by max_output_tokens)."""
        events = [] if self.output else self._open_message()
        return events + self._close_open("completed" if complete else "incomplete")

    def _text(self, text: str, logprobs: list[dict]) -> list[dict]:
        events = []
        if self._open is None or self.output[self._open]["type"] != "message":
            events += self._close_open("completed") + self._open_message()
        index = self._open
        part = self.output[index]["content"][0]
        part["text"] += text
        if self._want_logprobs:
            part["logprobs"].extend(logprobs)
        events.append({"type": "response.output_text.delta", "item_id": self.output[index]["id"],
                       "output_index": index, "content_index": 0, "delta": text, "logprobs": logprobs})
        return events

    def _open_message(self) -> list[dict]:
        self._open = len(self.output)
        item = {"id": item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}
        self.output.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], **({"logprobs": []} if self._want_logprobs
                                                                          else {})}
        events = [{"type": "response.output_item.added", "output_index": self._open, "item": _copy(item)},
                  {"type": "response.content_part.added", "item_id": item["id"], "output_index": self._open,
                   "content_index": 0, "part": dict(part, annotations=[])}]
        item["content"].append(part)
        return events

    def _call(self, index: int, call_id: str, name: str) -> list[dict]:
        events = self._close_open("completed")
        self._open = self._calls[index] = len(self.output)
        item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}
        self.output.append(item)
        return events + [{"type": "response.output_item.added", "output_index": self._open, "item": dict(item)}]

    def _arguments(self, index: int, text: str) -> list[dict]:
        at = self._calls[index]
        item = self.output[at]
        item["arguments"] += text
        return [{"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": at,
                 "delta": text}]

    def _close_open(self, status: str) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.output[index]
        item["status"] = status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"], "logprobs": part.get("logprobs", [])},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": _copy(part)}]
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        return events + [{"type": "response.output_item.done", "output_index": index, "item": _copy(item)}]


def _copy(value):
    """A deep copy of plain JSON (an event must not change when the item grows later)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
