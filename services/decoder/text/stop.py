"""Stop strings: find the first one completed in a stream of text deltas, never emitting part of one.

"First" means the occurrence that ends earliest in the text (at equal ends, the longer one): that is
the moment generation would have stopped, and it is the same however the text is cut into deltas
(a rule like "earliest start" is not: with stops "abc" and "b", "ab" completes "b" before "abc"
could be known).

A stop string can be split across deltas ("<|" then "end|>"), so the matcher holds back the longest
tail of the text that is a prefix of some stop string; that tail is released once it can no longer
start a match (or at the end). Every match therefore starts inside held + delta, which is searched
whole: a match starting in text already emitted would make that emitted suffix a longer stop-string
prefix than the held tail, which the hold rule excludes.

Limits (a request over them is refused with InvalidArgument, before it reaches the engine):
at most MAX_STOP_STRINGS strings, each 1..MAX_STOP_STRING_CHARS characters. They bound the
per-step work (the held tail is < 256 chars and the prefix set < 16*256 entries).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import InvalidArgument

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def validate_stop_strings(stop: str | Sequence[str] | None, param: str = "stop") -> tuple[str, ...]:
    """A request's `stop` (None, one string or a list, as OpenAI accepts) -> tuple of distinct strings.

    Raises InvalidArgument: not strings, empty strings, more than MAX_STOP_STRINGS, or one longer than
    MAX_STOP_STRING_CHARS characters.
    """
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise InvalidArgument(f"{param} must be a string or a list of strings", param=param)
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(items)}", param=param)
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise InvalidArgument(f"{param}[{i}] must be a string, got {type(s).__name__}", param=param)
        if not s:
            raise InvalidArgument(f"{param}[{i}] is empty", param=param)
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"{param}[{i}] is {len(s)} characters; the limit is {MAX_STOP_STRING_CHARS}",
                                  param=param)
    return tuple(dict.fromkeys(items))


@dataclass(frozen=True)
class StopResult:
    """What one delta produced.

    text: the text to send now (never part of a stop string unless include_stop_str_in_output).
    stop: the stop string that ended the request, or None while it goes on.
    """

    text: str
    stop: str | None = None


class StopMatcher:
    """Per-request matcher over text deltas.

    Args:
        stop: validated stop strings (see validate_stop_strings).
        include_stop_str_in_output: emit the matched stop string itself at the end of the text.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self.stop = tuple(stop)
        self.include = include_stop_str_in_output
        # Every proper prefix of every stop string: the tails worth holding back.
        self._prefixes = frozenset(s[:k] for s in self.stop for k in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self.stop), default=0)
        self._held = ""
        self.matched: str | None = None

    def feed(self, delta: str, judge: bool = True) -> StopResult:
        """Add one text delta. After a match every later call returns empty text with the same stop.

        judge=False (min_tokens not reached yet): the delta cannot end the request; only stop strings
        that end in a later, judged delta count (vLLM checks only the new text once past min_tokens).
        """
        if self.matched is not None:
            return StopResult("", self.matched)
        if not self.stop:
            return StopResult(delta)
        text = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, -length, stop): first completed, then longest
        for s in self.stop if judge else ():
            # Only occurrences that end inside the delta: the held tail holds no judged match (it was
            # searched already) and an unjudged one does not count.
            at = text.find(s, max(0, len(self._held) - len(s) + 1))  # the first occurrence ends first
            if at >= 0 and (best is None or (at + len(s), -len(s)) < best[:2]):
                best = (at + len(s), -len(s), s)
        if best is not None:
            end, _, s = best
            at = end - len(s)
            self.matched = s
            self._held = ""
            return StopResult(text[: at + len(s)] if self.include else text[:at], s)
        hold = 0
        for k in range(min(len(text), self._max_hold), 0, -1):
            if text[-k:] in self._prefixes:
                hold = k
                break
        self._held = text[len(text) - hold:] if hold else ""
        return StopResult(text[: len(text) - hold])

    def flush(self) -> str:
        """The request ended without a stop string: release the held tail."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    @property
    def held(self) -> str:
        """Text withheld so far (a possible start of a stop string)."""
        return self._held
