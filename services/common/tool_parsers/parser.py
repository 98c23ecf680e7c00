"""What every tool-call parser is: an incremental, per-choice reader of text deltas that returns events.

- Content(text): text for the message's `content`;
- CallName(index, name): call `index` (0, 1, ... within the choice) begins;
- CallArguments(index, text): a piece of call `index`'s arguments (JSON text; the pieces concatenate).

Any split of the same text into deltas must yield the same content and calls (the tests feed one character
at a time and all at once), so a streamed answer and a whole one always agree.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallName:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallName | CallArguments


class ToolCallParser:
    """One choice's reader. Subclasses set `name` (the --tool-call-parser value) and `call_end`."""

    name = ""
    # Who writes the format and what it looks like, for --help.
    about = ""
    # Text that ends one call: with parallel_tool_calls false it becomes a stop string, so generation ends after
    # the first call instead of writing more calls that would have to be thrown away.
    call_end = ""

    def feed(self, text: str) -> list[Event]:
        """Events for one more text delta (text that may still turn out to be a tag is held back)."""
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """Events for what is still held when the choice ends. Call once."""
        raise NotImplementedError

    @classmethod
    def parse(cls, text: str) -> list[Event]:
        """The events of a whole text: what feeding it in any pieces gives."""
        parser = cls()
        return parser.feed(text) + parser.finish()
