"""The hermes tool-call parser on hand-written text, fed whole, one character at a time, and at every split.

What it must do (services/common/tool_parsers/hermes.py): text outside the tags is content, a partial
`<tool_call>` is never sent as content, a well-formed block is a call (name first, then its arguments), a
malformed block stays content verbatim (per block; vLLM's whole-output fallback would break streaming),
whitespace around calls is dropped, and any split of the same text gives the same answer.
"""
from __future__ import annotations

import json

import pytest

from services.common.tool_parsers import PARSERS, CallArguments, CallName, Content, HermesParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def run(pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], every event) of feeding pieces in order."""
    parser = HermesParser()
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallName):
            assert e.index == len(calls), "calls are numbered in order"
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArguments):
            assert e.index in calls, "arguments come after their call's name"
            calls[e.index][1] += e.text
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content, [tuple(c) for c in calls.values()], events


def splits(text: str):
    """The text whole, one character at a time, and cut in two at every position."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


CASES = [
    ("no tags at all", "Paris is sunny today.", "Paris is sunny today.", []),
    ("one call", CALL, "", [("get_weather", '{"city": "Paris", "unit": "°C"}')]),
    ("text before a call", "Let me check.\n" + CALL, "Let me check.", [("get_weather", '{"city": "Paris", '
                                                                                         '"unit": "°C"}')]),
    ("two calls", CALL + "\n" + CALL2 + "\n", "", [("get_weather", '{"city": "Paris", "unit": "°C"}'),
                                                   ("get_time", "{}")]),
    ("text after a call", CALL + "\nDone.", "Done.", [("get_weather", '{"city": "Paris", "unit": "°C"}')]),
    ("arguments omitted", '<tool_call>{"name": "ping"}</tool_call>', "", [("ping", "{}")]),
    ("unclosed last block", "<tool_call>\n" + '{"name": "ping", "arguments": {"n": 1}}\n', "", [("ping", '{"n": 1}')]),
    ("malformed JSON stays content", '<tool_call>{"name": "f", "arguments": {oops}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {oops}</tool_call>', []),
    ("a body that is not a call stays content", '<tool_call>[1, 2]</tool_call>', '<tool_call>[1, 2]</tool_call>', []),
    ("arguments that are not an object", '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
    ("one malformed block beside a good one", CALL + "\n<tool_call>{nope</tool_call>",
     "<tool_call>{nope</tool_call>", [("get_weather", '{"city": "Paris", "unit": "°C"}')]),
    ("unclosed garbage", "Hmm <tool_call>{\"name\": ", 'Hmm <tool_call>{"name": ', []),
    ("a partial tag at the end is text", "a < b and <tool_", "a < b and <tool_", []),
    ("tag-like text that is no tag", "<tool>x</tool> <tool_cal", "<tool>x</tool> <tool_cal", []),
    ("whitespace kept without calls", "  two  spaces \n\n", "  two  spaces \n\n", []),
]


@pytest.mark.parametrize("text, content, calls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_split_gives_the_same_answer(text, content, calls):
    for pieces in splits(text):
        got_content, got_calls, _ = run(pieces)
        assert (got_content, got_calls) == (content, calls), pieces


def test_arguments_are_json_and_non_ascii_is_kept():
    _, calls, _ = run([CALL])
    assert json.loads(calls[0][1]) == {"city": "Paris", "unit": "°C"} and "°C" in calls[0][1]


@pytest.mark.parametrize("cut", range(1, len("<tool_call>")))
def test_a_tag_split_across_deltas_never_leaks(cut):
    parser = HermesParser()
    first = parser.feed("Sure. " + "<tool_call>"[:cut])
    assert first == [Content("Sure.")]            # the space waits: it may only separate the text from a call
    second = parser.feed("<tool_call>"[cut:] + '{"name": "f", "arguments": {}}')
    assert second == []                            # the block is judged at its end tag
    assert parser.feed("</tool_call>") == [CallName(0, "f"), CallArguments(0, "{}")]
    assert parser.finish() == []


def test_content_streams_as_it_arrives():
    parser = HermesParser()
    assert parser.feed("Hello") == [Content("Hello")]
    assert parser.feed(" world, ") == [Content(" world,")]
    assert parser.feed("then") == [Content(" then")]
    assert parser.finish() == []


def test_a_malformed_block_is_content_once_closed():
    parser = HermesParser()
    assert parser.feed("<tool_call>{broken") == []
    assert parser.feed("</tool_call>") == [Content("<tool_call>{broken</tool_call>")]


def test_the_registry_names_vllms_parser():
    assert PARSERS == {"hermes": HermesParser} and HermesParser.call_end == "</tool_call>"
    assert HermesParser.parse(CALL2) == [CallName(0, "get_time"), CallArguments(0, "{}")]
