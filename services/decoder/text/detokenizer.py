"""Incremental detokenisation: one request's generated ids -> text deltas, never a broken UTF-8 character.

Decoding each new id on its own is wrong for every common tokenizer: ByteLevel and byte-fallback
tokenizers split one character over several ids, and SentencePiece-style decoders drop or keep a
word's leading space depending on what precedes it. Decoding everything again each step is right but
O(length). The window below (the scheme vLLM and TGI use) is both: decode
`ids[prefix_offset:]` and `ids[prefix_offset:read_offset]`, and the new text is what the first has
beyond the second. The window only spans the last emitted chunk plus the ids not yet emitted, so a
step costs O(new tokens).

While the window's text ends in U+FFFD the last ids may be an incomplete UTF-8 sequence, so nothing is
emitted until a later id completes it. `finish()` flushes what is still held (a genuinely invalid
byte sequence then does come out as U+FFFD, exactly as a full decode shows it). The deltas
concatenate to `tokenizer.decode(all ids, skip_special_tokens)` whenever that decode is valid text,
and always for ByteLevel tokenizers, which replace invalid bytes locally.

Known limit: a byte-fallback decoder (Llama's <0xNN> tokens) turns a whole run of byte tokens into
U+FFFDs when the run is not valid UTF-8, which can rewrite characters of that run already sent. We
keep streaming each completed character rather than hold every byte run until a non-byte token
arrives, which would stall text that such tokenizers spell in bytes (much CJK); only invalid model
output is affected.
"""
from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer as HFTokenizer

from services.decoder.text.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-request state. Not thread-safe; one engine thread owns it.

    Args:
        tokenizer: our Tokenizer (or a raw tokenizers.Tokenizer).
        skip_special_tokens: drop special added tokens (eos, chat markers) from the text, as decode does.
    """

    def __init__(self, tokenizer: Tokenizer | HFTokenizer, skip_special_tokens: bool = True):
        self._backend = tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        # ids[prefix_offset:read_offset] is the last chunk whose text was emitted: the context that makes
        # the next ids decode as they would inside the whole sequence.
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._backend.decode(self.ids[start:end], skip_special_tokens=self._skip)

    def add(self, new_ids: Iterable[int]) -> str:
        """Append generated ids [K]; return the text they complete ("" while a character is still partial)."""
        self.ids.extend(new_ids)
        if len(self.ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if new_text.endswith(REPLACEMENT_CHAR):
            return ""
        if len(new_text) <= len(prefix_text):
            # Only ids that decode to nothing (skipped specials): move the read point so the window stays small.
            self._read_offset = len(self.ids)
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return delta

    def finish(self) -> str:
        """Flush text still held back (an incomplete UTF-8 tail at the end shows as U+FFFD). Call once, at the end."""
        if len(self.ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return delta
