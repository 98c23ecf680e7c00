"""tool_choice "required" and a named function: the JSON a grammar forces, and reading it back as calls.

The decoder's structured-output path (a JSON schema compiled by xgrammar) forces the calls, so their
arguments always parse and match the function's parameters, on any model, with or without a tool-call
format in its template (vLLM forces them the same way). The shapes:

- a named function: the output is its arguments object, `{"city": "Paris"}`;
- required: a non-empty array of calls (one at most with parallel_tool_calls false),
  `[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]`; each item is one of the tools, its
  `name` a const and its `arguments` that tool's parameters, kept under `$defs/<name>` with their own `$ref`s
  re-pointed there.

The grammar writes JSON compactly and properties in schema order, so a call's name arrives before its
arguments and the arguments can stream as they are written. The readers below are ToolCallParsers, so the
route treats them as it treats a model's own format.
"""
from __future__ import annotations

import copy
import json

from services.common.tool_parsers import CallArguments, CallName, Event, ToolCallParser

# Values of these keywords are data, not schemas: a "$ref" inside them is not a reference.
_DATA = frozenset({"enum", "const", "default", "examples"})


def object_schema(parameters: dict | None) -> dict:
    """A function's parameters as the object schema its arguments follow (OpenAI: omitted means no arguments)."""
    schema = copy.deepcopy(parameters) if parameters else {"type": "object", "properties": {}}
    schema.setdefault("type", "object")
    return schema


def _repoint(node, base: str):
    """node with every local `$ref` ("#..." ) rewritten to live under base (a JSON pointer like "#/$defs/f")."""
    if isinstance(node, list):
        return [_repoint(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA:
            out[key] = value
        else:
            out[key] = _repoint(value, base)
    return out


def required_schema(functions: list[tuple[str, dict | None]], parallel: bool) -> dict:
    """The array schema of tool_choice "required" for [(name, parameters)]."""
    defs = {}
    items = []
    for name, parameters in functions:
        schema = object_schema(parameters)
        # Nested, "$schema"/"$id" would re-base the references (and mean nothing to the grammar).
        schema.pop("$schema", None)
        schema.pop("$id", None)
        defs[name] = _repoint(schema, f"#/$defs/{name}")
        items.append({"type": "object", "properties": {"name": {"const": name},
                                                       "arguments": {"$ref": f"#/$defs/{name}"}},
                      "required": ["name", "arguments"]})
    array = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return {**array, "$defs": defs}


class NamedCall(ToolCallParser):
    """The output of a named tool_choice: all of it is call 0's arguments."""

    name = "named"

    def __init__(self, function: str):
        self._function = function
        self._started = False

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [CallName(0, self._function)]

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        return [*self._start(), CallArguments(0, text)]

    def finish(self) -> list[Event]:
        return self._start()   # a choice cut before any text still made its (empty) call


class RequiredCalls(ToolCallParser):
    """The output of tool_choice "required": a JSON array of {"name", "arguments"} objects, read one character
    at a time. Depth 1 is inside the array, depth 2 inside a call; a call's values are read whole (its name)
    or streamed (its arguments) from their first character to the character that closes them."""

    name = "required"

    def __init__(self):
        self._depth = 0
        self._phase = "key"     # at depth 2: key, in_key, colon, value, in_value, next
        self._index = -1        # the call being read
        self._key_chars: list[str] = []
        self._key = ""
        self._value: list[str] = []
        self._kind = ""         # of the value being read: string, container or scalar
        self._nest = 0          # brackets open inside a container value
        self._in_string = False
        self._escape = False
        self._named = False     # CallName sent for the current call
        self._pending: list[str] = []   # argument text not yet sent

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for c in text:
            self._char(c, events)
        self._flush(events)
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        self._flush(events)   # a cut mid-call (finish_reason length) leaves its arguments unfinished
        return events

    def _flush(self, events: list[Event]) -> None:
        if self._named and self._pending:
            events.append(CallArguments(self._index, "".join(self._pending)))
            self._pending = []

    def _char(self, c: str, events: list[Event]) -> None:
        if self._depth == 2 and self._phase == "in_value":
            self._value_char(c, events)
        elif self._depth == 0:
            if c == "[":
                self._depth = 1
        elif self._depth == 1:
            if c == "{":
                self._depth, self._phase = 2, "key"
                self._index, self._named, self._pending = self._index + 1, False, []
            elif c == "]":
                self._depth = 0
        elif self._phase == "key":
            if c == '"':
                self._phase, self._key_chars = "in_key", [c]
            elif c == "}":
                self._end_call(events)
        elif self._phase == "in_key":
            self._key_chars.append(c)
            if self._string_closed(c):
                self._key, self._phase = json.loads("".join(self._key_chars)), "colon"
        elif self._phase == "colon":
            if c == ":":
                self._phase = "value"
        elif self._phase == "value":
            if not c.isspace():
                self._phase, self._value, self._nest = "in_value", [], 0
                self._kind = "string" if c == '"' else "container" if c in "{[" else "scalar"
                self._value_char(c, events)
        elif self._phase == "next":
            if c == ",":
                self._phase = "key"
            elif c == "}":
                self._end_call(events)

    def _string_closed(self, c: str) -> bool:
        """Track a string's escapes; True at its closing quote (the opening quote was seen already)."""
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            return True
        return False

    def _value_char(self, c: str, events: list[Event]) -> None:
        if self._kind == "scalar" and (c in ",}" or c.isspace()):
            self._end_value(events)
            self._char(c, events)   # the character that ended it belongs to the call
            return
        self._take(c)
        if self._in_string:
            if self._string_closed(c):
                self._in_string = False
                if self._kind == "string":
                    self._end_value(events)
        elif c == '"' and (self._kind == "container" or len(self._value) == 1):
            self._in_string = True
        elif self._kind == "container" and c in "{[":
            self._nest += 1
        elif self._kind == "container" and c in "}]":
            self._nest -= 1
            if self._nest == 0:
                self._end_value(events)

    def _take(self, c: str) -> None:
        self._value.append(c)
        if self._key == "arguments":
            self._pending.append(c)

    def _end_value(self, events: list[Event]) -> None:
        self._phase = "next"
        if self._key == "name" and not self._named:
            name = json.loads("".join(self._value))
            if isinstance(name, str):
                self._named = True
                events.append(CallName(self._index, name))
                self._flush(events)   # arguments written before the name (not what the grammar does)

    def _end_call(self, events: list[Event]) -> None:
        self._flush(events)
        self._depth = 1
