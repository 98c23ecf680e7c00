"""A compiled constraint, and the per-vocabulary token bits every mask of it is combined with.

Bit rows use xgrammar's bitmask layout: int32 [W], W = ceil(V / 32), token t is bit t % 32 of
word t // 32, 1 = allowed. V is the model's logits width (config vocab_size), not the tokenizer's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from services.decoder.grammar.spec import GrammarSpec

# Kinds whose output is JSON text; a raw control byte (< 0x20) is never valid there.
JSON_KINDS = frozenset({"json_schema", "json_object"})


def bit_row(allowed: np.ndarray) -> torch.Tensor:
    """bool [V] -> int32 [ceil(V / 32)] in xgrammar's layout."""
    words = -(-len(allowed) // 32)
    padded = np.zeros(words * 32, dtype=bool)
    padded[:len(allowed)] = allowed
    # packbits little-endian within each byte, and bytes little-endian within each int32 word (x86, arm64).
    return torch.from_numpy(np.packbits(padded, bitorder="little").view("<i4").astype(np.int32))


@dataclass(frozen=True, eq=False)
class TokenBits:
    """Static bit rows of one vocabulary (int32 [W]).

    no_stop: every token but the stop tokens (a mask with nothing left after `& no_stop` allows only
    a stop). plain: every token but the special ones (chat markers, <|endoftext|>) and the empty ids
    past the tokenizer's end; the stop tokens stay. xgrammar matches a special token by its text,
    but the detokenizer drops it from the answer, which would then not be what the grammar matched.
    json_text: plain, less every token holding a control byte (< 0x20): xgrammar 0.2.8 lets a
    length-bounded JSON string (maxLength) take a raw one, which is invalid JSON. JSON is written
    compactly, so no newline or tab is needed outside strings either; inside them they are escaped.
    """

    vocab_size: int
    stop_token_ids: tuple[int, ...]
    no_stop: torch.Tensor
    plain: torch.Tensor
    json_text: torch.Tensor

    @classmethod
    def build(cls, info: xgr.TokenizerInfo, stop_token_ids: tuple[int, ...],
              special_token_ids: frozenset[int] = frozenset()) -> TokenBits:
        size = info.vocab_size
        stops = np.zeros(size, dtype=bool)
        stops[list(stop_token_ids)] = True
        special = np.zeros(size, dtype=bool)
        special[[t for t in special_token_ids if 0 <= t < size]] = True
        control = np.zeros(size, dtype=bool)
        for token, raw in enumerate(info.decoded_vocab[:size]):
            special[token] |= not raw
            control[token] = any(b < 0x20 for b in raw)
        plain = ~special | stops
        return cls(size, stop_token_ids, bit_row(~stops), bit_row(plain), bit_row(plain & (~control | stops)))


@dataclass(frozen=True, eq=False)
class Grammar:
    """One compiled spec, shared read-only by every request (and choice) that asks for it; each
    request gets its own matcher (services/decoder/grammar/state.py)."""

    spec: GrammarSpec
    compiled: xgr.CompiledGrammar
    bits: TokenBits

    @property
    def ban(self) -> torch.Tensor:
        """int32 [W] ANDed into every mask of this grammar (TokenBits)."""
        return self.bits.json_text if self.spec.kind in JSON_KINDS else self.bits.plain
