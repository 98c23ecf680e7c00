"""Tokenizer wrapper vs transformers' AutoTokenizer: ids, decode, special tokens, stop ids, id validation."""
from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.decoder.text.tokenizer import Tokenizer
from tests.decoder.text.conftest import CORPUS, hf_tokenizer

SAMPLES = CORPUS + [
    "", " ", "  leading spaces", "trailing space ", "a\n\nb", "<|im_start|>user\nhi<|im_end|>",
    "mixed 😀é日本 text", "</s> and <s> inline", "\ufffd replacement char", "tab\there",
]
# Text hypothesis draws from: ASCII, accents, CJK, emoji and the tokens' own markup.
TEXT = st.lists(st.one_of(st.characters(codec="utf-8", exclude_categories=("Cs",)),
                          st.sampled_from(["<|im_end|>", "<s>", " ", "😀", "é", "日"])), max_size=40).map("".join)


def test_encode_decode_match_transformers(any_dir):
    ours, ref = Tokenizer.from_folder(any_dir), hf_tokenizer(any_dir)
    for text in SAMPLES:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == ref.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_encode_matches_transformers_on_random_text(bytefallback_dir, text):
    ours, ref = _pair(bytefallback_dir)
    assert ours.encode(text) == ref.encode(text)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == ref.decode(ref.encode(text))


_CACHE: dict = {}


def _pair(folder):
    if folder not in _CACHE:
        _CACHE[folder] = Tokenizer.from_folder(folder), hf_tokenizer(folder)
    return _CACHE[folder]


def test_special_tokens_match_transformers(any_dir):
    ours, ref = Tokenizer.from_folder(any_dir), hf_tokenizer(any_dir)
    assert ours.special_tokens_map == ref.special_tokens_map
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.vocab_size == len(ref)
    assert ours.all_special_ids == set(ref.all_special_ids) | {
        i for i, t in ref.added_tokens_decoder.items() if t.special}


def test_stop_ids_follow_generation_config_then_config_then_eos(bytelevel_dir, bytefallback_dir, smollm2_dir):
    # generation_config.json's eos list wins (the fixture writes [2, 0]).
    assert Tokenizer.from_folder(bytelevel_dir).stop_token_ids == (2, 0)
    # no generation config: config.json's eos_token_id.
    assert Tokenizer.from_folder(bytefallback_dir).stop_token_ids == (2,)
    smol = Tokenizer.from_folder(smollm2_dir)
    assert smol.eos_token_id in smol.stop_token_ids


def test_special_tokens_map_json_is_ignored_when_config_has_added_tokens_decoder(bytefallback_dir, tmp_path):
    # transformers 5 reads special_tokens_map.json only for legacy configs without added_tokens_decoder.
    folder = tmp_path / "tok"
    shutil.copytree(bytefallback_dir, folder)
    config = {"tokenizer_class": "TokenizersBackend", "eos_token": "<unk>",
              "added_tokens_decoder": {"2": {"content": "</s>", "special": True, "lstrip": False, "rstrip": False,
                                             "normalized": False, "single_word": False}}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = Tokenizer.from_folder(folder), hf_tokenizer(folder)
    assert ours.special_tokens_map == ref.special_tokens_map == {"eos_token": "<unk>"}
    assert ours.eos_token_id == ref.eos_token_id


def test_special_token_missing_from_vocab_is_added_like_transformers(bytelevel_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(bytelevel_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|eot|>"
    config["additional_special_tokens"] = ["<tool>", "<|im_start|>"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = Tokenizer.from_folder(folder), hf_tokenizer(folder)
    assert ours.vocab_size == len(ref)
    assert ours.eos_token_id == ref.eos_token_id == ref.convert_tokens_to_ids("<|eot|>")
    text = "a<|eot|>b<tool>c"
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_split_special_tokens_encodes_markup_as_text(bytelevel_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(bytelevel_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["split_special_tokens"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = Tokenizer.from_folder(folder), hf_tokenizer(folder)
    text = "<|im_start|>user"
    assert ours.encode(text) == ref.encode(text)
    assert 1 not in ours.encode(text)


def test_validate_ids(bytelevel_dir):
    tok = Tokenizer.from_folder(bytelevel_dir)
    assert tok.validate_ids([0, 5, tok.vocab_size - 1]) == [0, 5, tok.vocab_size - 1]
    for bad in ([tok.vocab_size], [-1], [1, 2, 10**9], ["3"], [True], [1.0]):
        with pytest.raises(InvalidArgument) as err:
            tok.validate_ids(bad)
        assert err.value.param == "prompt"
    # a model with fewer embedding rows than the tokenizer's vocab narrows the bound.
    with pytest.raises(InvalidArgument):
        tok.validate_ids([10], limit=10)


def test_encode_refuses_non_text(bytelevel_dir):
    with pytest.raises(InvalidArgument):
        Tokenizer.from_folder(bytelevel_dir).encode(["not", "text"])


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
