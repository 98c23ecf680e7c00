"""Stop strings over text deltas: earliest match, split across deltas, never a partial stop string out."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.decoder.text.stop import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    StopMatcher,
    StopResult,
    validate_stop_strings,
)


def _run(stop, deltas, include=False):
    """Feed deltas; returns (emitted text, the stop that matched or None), flushing if no stop."""
    m = StopMatcher(stop, include)
    out = []
    for d in deltas:
        r = m.feed(d)
        out.append(r.text)
        if r.stop is not None:
            return "".join(out), r.stop
    return "".join(out) + m.flush(), None


def _split(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_stop_split_across_deltas():
    assert _run(["<|end|>"], ["Hello <|", "en", "d|> tail"]) == ("Hello ", "<|end|>")
    assert _run(["<|end|>"], ["Hello <|", "en", "d|> tail"], include=True) == ("Hello <|end|>", "<|end|>")


def test_partial_match_is_held_then_released():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST").text == "abc "
    assert m.held == "ST"
    assert m.feed("OR").text == "STOR"  # no tail of "STOR" can start "STOP" any more: all released
    assert m.held == ""


def test_release_keeps_a_shorter_prefix_tail():
    m = StopMatcher(["abab"])
    assert m.feed("xaba").text == "x"
    r = m.feed("c")
    assert (r.text, r.stop, m.held) == ("abac", None, "")
    r = m.feed("aba")
    assert (r.text, m.held) == ("", "aba")
    assert m.feed("b").stop == "abab"


def test_first_completed_stop_wins_then_longest():
    assert _run(["world", "o w"], ["hello world"]) == ("hell", "o w")
    assert _run(["abc", "b"], ["xabc"]) == ("xa", "b")  # "b" completes first, wherever the text is cut
    assert _run(["abc", "b"], ["xa", "bc"]) == ("xa", "b")
    assert _run(["bc", "abc"], ["xabcd"]) == ("x", "abc")  # same end: the longer one


def test_unjudged_text_cannot_stop_and_only_later_text_counts():
    """min_tokens: deltas fed with judge=False never end the request; a stop string counts once it ends in
    a judged delta, even if it started in unjudged text (vLLM searches the new text only)."""
    m = StopMatcher(["END", "b", "abc"])
    assert m.feed("xx END ab", judge=False) == StopResult("xx END ")   # "END" and "b" unjudged; "ab" held
    assert m.held == "ab"
    assert m.feed("d") == StopResult("abd")                             # the held "b" was not judged
    m = StopMatcher(["END"])
    assert m.feed("EN", judge=False).text == "" and m.held == "EN"
    assert m.feed("D tail") == StopResult("", "END")                    # ends in the judged delta


def test_no_stop_strings_passes_through():
    m = StopMatcher([])
    assert m.feed("anything").text == "anything"
    assert m.flush() == ""


def test_after_stop_nothing_more_is_emitted():
    m = StopMatcher(["."])
    assert m.feed("a.b").text == "a"
    assert m.feed("more").text == "" and m.flush() == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab.<|>é😀 ", max_size=40),
       stops=st.lists(st.text(alphabet="ab.<|>é😀 ", min_size=1, max_size=4), min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 60), max_size=8), include=st.booleans())
def test_any_split_equals_whole_text_search(text, stops, cuts, include):
    # Streaming in any pieces gives the same result as searching the whole text at once.
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if found:
        end, _, s = min(found)
        expected = (text[:end] if include else text[: end - len(s)], s)
    else:
        expected = (text, None)
    assert _run(stops, _split(text, cuts), include) == expected
    # Nothing emitted before the end is ever the start of a stop string that then completes.
    m = StopMatcher(stops, include)
    emitted = ""
    for piece in _split(text, cuts):
        r = m.feed(piece)
        emitted += r.text
        if r.stop is None:
            assert not any(s in emitted for s in stops)


def test_validate_stop_strings():
    assert validate_stop_strings(None) == ()
    assert validate_stop_strings("x") == ("x",)
    assert validate_stop_strings(["a", "b", "a"]) == ("a", "b")
    assert len(validate_stop_strings(["s"] * 1 + [str(i) for i in range(MAX_STOP_STRINGS - 1)])) == MAX_STOP_STRINGS
    assert validate_stop_strings(["x" * MAX_STOP_STRING_CHARS]) == ("x" * MAX_STOP_STRING_CHARS,)


@pytest.mark.parametrize("bad", [
    [str(i) for i in range(MAX_STOP_STRINGS + 1)],
    ["x" * (MAX_STOP_STRING_CHARS + 1)],
    [""],
    [1],
    5,
    {"a": 1},
])
def test_bad_stop_strings_are_refused(bad):
    with pytest.raises(InvalidArgument) as err:
        validate_stop_strings(bad)
    assert err.value.param == "stop"
