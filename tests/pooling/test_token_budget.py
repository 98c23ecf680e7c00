"""services/common/token_budget.py on the served tokenizers: a word-boundary prefix's ids are the whole
text's first ids, so refusing or truncating from the prefix is what the whole text would get."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.common.token_budget import leading_ids, leading_prefix, word_end

MODELS = Path(__file__).resolve().parents[2] / "models"
FOLDERS = ("SmolLM2-135M-Instruct", "all-MiniLM-L6-v2", "minilm-gsm8k-reranker")
# Words that stress the pre-tokenizers: punctuation runs, digits, newlines, accents and combining marks,
# CJK (BERT spaces it), contractions, repeated spaces.
WORDS = ("hello", "world,", "it's", "12345", "3.14", "--", "\n", "e\u0301t\u00e9", "\u4e2d\u6587", "Caf\u00c9",
         "  ", "x", "...", "\t", "na\u00efve", "\U0001f600", "ID_42", "<tag>")


def tokenizer(name: str) -> Tokenizer:
    path = MODELS / name / "tokenizer.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make models` (make test does)")
    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()
    return tok


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def test_word_end():
    assert word_end("ab cd", 0) == 2 and word_end("ab cd", 2) == 2 and word_end("ab cd", 3) is None
    assert word_end("a  b c", 2) == 4          # never inside a run of spaces
    assert word_end("a\n b", 0) is None        # a newline, then a space: not a word's end


@pytest.mark.parametrize("name", FOLDERS)
def test_a_prefix_has_the_whole_texts_first_ids(name):
    tok = tokenizer(name)

    def encode(part: str) -> list[int]:
        return tok.encode(part, add_special_tokens=False).ids
    for seed in range(20):
        whole_text = text(seed, 400)
        whole = encode(whole_text)
        for limit in (5, 50, 300):
            found = leading_prefix(encode, whole_text, limit, first_chars=limit)
            assert found is not None
            ids, end = found
            assert len(ids) >= limit and whole[:len(ids)] == ids, (seed, limit, whole_text[:end][-40:])
    short = "hello world"
    assert leading_ids(encode, short, 2, first_chars=100) == (encode(short), len(short))


@pytest.mark.parametrize("name", FOLDERS[1:])
def test_truncating_the_prefix_truncates_like_the_whole_text(name):
    tok = tokenizer(name)
    cut = Tokenizer.from_file(str(MODELS / name / "tokenizer.json"))
    cut.no_padding()
    cut.enable_truncation(128, strategy="longest_first")

    def encode(part: str) -> list[int]:
        return tok.encode(part, add_special_tokens=False).ids
    for seed in range(10):
        long_text, short_text = text(seed, 3000), text(seed + 100, 20)
        _, end = leading_prefix(encode, long_text, 129)
        assert end < len(long_text)
        prefix = long_text[:end]
        assert cut.encode(prefix).ids == cut.encode(long_text).ids
        # A pair whose one side is cut (rerank's query or document).
        assert cut.encode(short_text, prefix).ids == cut.encode(short_text, long_text).ids
        assert cut.encode(prefix, short_text).ids == cut.encode(long_text, short_text).ids
