"""Tokenize no more of a text than a token limit can use: a 15 MB prompt against a 2,048-token context is
judged from its first few kilobytes, not tokenized whole.

    ids, end = leading_ids(encode, text, limit)

`encode` maps a text to its ids (callers run this off their event loop, through a tokenizers call that
releases the GIL; special tokens it adds, a leading BOS, are the same for every text). With end < len(text),
`ids` are those of text[:end], at least `limit` of them, and text's own ids begin with these: the caller can
refuse (text certainly has at least len(ids) tokens) or truncate (text[:end] truncates to the same ids)
without the rest.

Why a prefix's ids are the text's own first ids: the prefix ends at a word boundary, a non-space character
followed by a space (U+0020). Every pre-tokenizer the served models use splits there and looks no further
ahead than that space: byte-level BPE's regexes (GPT-2, Llama 3, Qwen2: a letter, digit or punctuation run
ends at the space; the whitespace rules only see runs that start at it), Metaspace (it splits before each
space), and BERT's whitespace-and-punctuation split. Normalizers (NFC, lowercasing, accent stripping, the
CJK spacing) act on single characters or on a base character with the combining marks after it, never
across a plain space. So the text's pre-tokens are the prefix's followed by the rest's, and the model
(BPE, WordPiece, Unigram) encodes each pre-token on its own. tests/pooling/test_token_budget.py checks the
equality on the served tokenizers.

Prefixes double from `first_chars` until one holds `limit` ids, so the work is at most about twice the
shortest prefix that does. A text with no word boundary past `first_chars` (one 15 MB word) is tokenized
whole: nothing safe to cut at.
"""
from __future__ import annotations

import re
from collections.abc import Callable

# A non-space character followed by a space: the index after the first is a safe end for a prefix.
_WORD_END = re.compile(r"\S ")
# Where the first prefix ends, in characters per token of the limit: English runs ~4 characters per token,
# so a text under this many characters is tokenized whole at once (almost every prompt that fits is).
FIRST_CHARS_PER_TOKEN = 8


def word_end(text: str, at: int) -> int | None:
    """The smallest index i >= at with text[i - 1] not a space and text[i] == " ", or None."""
    found = _WORD_END.search(text, max(at - 1, 0))
    return None if found is None else found.start() + 1


def leading_prefix(encode: Callable[[str], list[int]], text: str, limit: int,
                   first_chars: int | None = None) -> tuple[list[int], int] | None:
    """(ids, end): the first word-boundary prefix text[:end] whose ids number at least limit, with its ids,
    the first ids of text (module docstring); None when there is none (text must be tokenized whole).
    limit >= 1."""
    at = first_chars if first_chars is not None else limit * FIRST_CHARS_PER_TOKEN
    while at < len(text):
        end = word_end(text, at)
        if end is None:
            return None
        ids = encode(text[:end])
        if len(ids) >= limit:
            return ids, end
        at = 2 * end
    return None


def leading_ids(encode: Callable[[str], list[int]], text: str, limit: int,
                first_chars: int | None = None) -> tuple[list[int], int]:
    """(ids, end): leading_prefix's, or all of text's ids and end = len(text) when it has no such prefix."""
    found = leading_prefix(encode, text, limit, first_chars)
    return found if found is not None else (encode(text), len(text))
