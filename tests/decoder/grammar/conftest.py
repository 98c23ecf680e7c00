"""The grammar tests' compiler: SmolLM2's real tokenizer at the model's logits width (49,152)."""
from __future__ import annotations

import numpy as np
import pytest

from services.decoder.grammar.compiled import Grammar
from services.decoder.grammar.compiler import GrammarCompiler
from services.decoder.grammar.state import GrammarState
from services.decoder.text.tokenizer import Tokenizer
from tests.decoder.server.conftest import need_smollm2

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(need_smollm2())


@pytest.fixture(scope="session")
def compiler(tokenizer) -> GrammarCompiler:
    c = GrammarCompiler(tokenizer.backend, vocab_size=VOCAB, stop_token_ids=(EOS,),
                        special_token_ids=tokenizer.all_special_ids, cache_size=64)
    yield c
    c.close()


def allowed(mask) -> np.ndarray:
    """int32 [W] mask -> the allowed token ids."""
    return np.nonzero(np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:VOCAB])[0]


def walk(grammar: Grammar, rng: np.random.Generator, cap: int = 200, p_stop: float = 0.5) -> list[int] | None:
    """Random tokens the grammar allows, as a model with no preference would pick them, ending at a stop
    (taken with p_stop once allowed) or when the grammar completes; None if it ran past cap tokens."""
    import torch
    state = GrammarState(grammar)
    tokens: list[int] = []
    for _ in range(cap):
        mask = torch.empty_like(grammar.bits.no_stop)
        state.fill(mask)
        ids = allowed(mask)
        if EOS in ids and (len(ids) == 1 or rng.random() < p_stop):
            return tokens
        token = int(rng.choice(ids[ids != EOS]))
        tokens.append(token)
        if state.advance(token):
            return tokens
    return None
