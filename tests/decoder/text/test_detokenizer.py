"""Incremental detokenisation: deltas never break a character and concatenate to the full decode."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.decoder.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from services.decoder.text.tokenizer import Tokenizer

_TOKENIZERS: dict = {}
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Text drawn from the alphabets that split into several ids: accents, CJK, emoji (with modifiers), specials.
PIECES = st.one_of(st.characters(codec="utf-8", exclude_categories=("Cs",)),
                   st.sampled_from(["😀", "👍🏽", "🇫🇷", "é", "日本", " ", "  ", "\n", "<|im_end|>", "</s>", "word"]))
TEXT = st.lists(PIECES, max_size=30).map("".join)


def _tok(folder) -> Tokenizer:
    if folder not in _TOKENIZERS:
        _TOKENIZERS[folder] = Tokenizer.from_folder(folder)
    return _TOKENIZERS[folder]


def _stream(tok, ids, chunks, skip=True):
    """Feed ids in chunks of the given sizes; returns (deltas, final flush)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)] if chunks else 1
        deltas.append(detok.add(ids[i:i + n]))
        i, k = i + n, k + 1
    return deltas, detok.finish()


@pytest.mark.parametrize("skip", [True, False])
@HYP
@given(text=TEXT, chunks=st.lists(st.integers(1, 4), max_size=5), data=st.data())
def test_valid_text_streams_without_replacement_chars(any_dir, skip, text, chunks, data):
    tok = _tok(any_dir)
    ids = tok.encode(text, add_special_tokens=data.draw(st.booleans()))
    deltas, tail = _stream(tok, ids, chunks, skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + tail == full
    if REPLACEMENT_CHAR not in full:
        assert all(REPLACEMENT_CHAR not in d for d in deltas)
        assert tail == ""


@HYP
@given(data=st.data(), chunks=st.lists(st.integers(1, 3), max_size=4))
def test_random_ids_concatenate_to_decode(any_dir, data, chunks):
    # Arbitrary ids may not form valid UTF-8. ByteLevel decoding replaces invalid bytes locally, so the stream
    # still ends equal to the full decode. A byte-fallback decoder turns a whole run of <0xNN> tokens into
    # U+FFFDs when the run is invalid, rewriting bytes already sent; there equality is only promised for
    # output that decodes to valid text (holding every byte run back would stall CJK-heavy streams).
    tok = _tok(any_dir)
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=25))
    deltas, tail = _stream(tok, ids, chunks)
    full = tok.decode(ids)
    if "bytefallback" not in str(any_dir) or REPLACEMENT_CHAR not in full:
        assert "".join(deltas) + tail == full
    if REPLACEMENT_CHAR not in full:
        assert all(REPLACEMENT_CHAR not in d for d in deltas)


def _byte_ids(tok, text):
    """ids of the single-byte tokens spelling text (ByteLevel alphabet or <0xNN> fallback tokens)."""
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in text.encode()]
    if None in ids:
        from tokenizers.pre_tokenizers import ByteLevel

        byte_to_char = _bytelevel_map()
        assert set(byte_to_char.values()) == set(ByteLevel.alphabet())
        ids = [tok.token_to_id(byte_to_char[b]) for b in text.encode()]
        assert None not in ids
    return ids


def _bytelevel_map():
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@pytest.mark.parametrize("name", ["bytelevel", "bytefallback"])
def test_emoji_split_into_bytes_is_held_until_complete(request, name):
    tok = _tok(request.getfixturevalue(f"{name}_dir"))
    ids = _byte_ids(tok, "a😀b")  # 1 + 4 + 1 byte tokens
    detok = IncrementalDetokenizer(tok)
    out = [detok.add([i]) for i in ids]
    assert out == ["a", "", "", "", "😀", "b"]
    assert detok.finish() == ""


def test_incomplete_tail_is_flushed_as_decode_shows_it(bytelevel_dir):
    tok = _tok(bytelevel_dir)
    ids = _byte_ids(tok, "x😀")[:-2]  # cut the emoji: x + 2 of its 4 bytes
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add([i]) for i in ids) == "x"
    assert "x" + detok.finish() == tok.decode(ids)


def test_special_tokens_are_skipped_and_window_stays_small(bytelevel_dir):
    tok = _tok(bytelevel_dir)
    eos = tok.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("Hello")) == "Hello"
    for _ in range(50):
        assert detok.add([eos]) == ""
    # Skipped ids move the read point, so the decode window does not grow with them.
    assert len(detok.ids) - detok._prefix_offset <= 51
    assert detok._read_offset == len(detok.ids)
    assert detok.add(tok.encode(" world")) == " world"


def test_window_is_bounded(bytelevel_dir):
    # O(new tokens) per step: after many emitted tokens each decode covers only the last chunk plus the new ids.
    tok = _tok(bytelevel_dir)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 20)
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.add([i])
        assert len(detok.ids) - detok._prefix_offset <= 2


def test_spaces_survive_in_metaspace_tokenizer(bytefallback_dir):
    tok = _tok(bytefallback_dir)
    text = "Hello world  two  spaces"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = _stream(tok, ids, [1])
    assert "".join(deltas) + tail == tok.decode(ids) == text
