"""The decoder's tokenizer: HF `tokenizers` over a model folder, special tokens resolved as transformers does.

At run time nothing here imports transformers; tests prove the ids, the special tokens and
the decoded text equal `AutoTokenizer.from_pretrained(folder)`'s.

What transformers 5 does when it loads a folder that has a tokenizer.json, mirrored here:
- tokenizer.json is the whole pipeline; `add_bos_token`/`add_eos_token` in tokenizer_config.json are
  dropped when tokenizer.json exists, so its post-processor alone decides what `add_special_tokens` adds.
- Named special tokens (bos, eos, unk, sep, pad, cls, mask) come from tokenizer_config.json; only when
  that file has no `added_tokens_decoder` does special_tokens_map.json (legacy) override them.
- A named or extra special token that is not one of tokenizer.json's added tokens is added as a special
  added token, so `decode(skip_special_tokens=True)` drops it.
- `split_special_tokens` makes special-token text encode as plain text.
The ids that end generation come from generation_config.json, else config.json, else the tokenizer's eos,
as `GenerationConfig` resolves them (an eos may be a list there).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from services.common.errors import InvalidArgument
from services.common.token_budget import leading_ids

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order: chat templates see these names as variables.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def read_json(path: Path) -> dict:
    """The JSON object in path, or {} when the file is absent."""
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value) -> str | None:
    """A special token as configs write it (a string or an AddedToken dict) -> its text."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"malformed special token entry: {value!r}")


def _as_added_token(value, special: bool) -> AddedToken:
    """A config entry -> tokenizers.AddedToken, keeping lstrip/rstrip/... when the entry carries them."""
    if isinstance(value, str):
        return AddedToken(value, special=special)
    fields = {k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value and k != "content"}
    fields.setdefault("special", special)
    return AddedToken(value["content"], **fields)


def _eos_ids(value) -> list[int]:
    """An eos_token_id field (absent, an int or a list of ints) -> list of ids."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class Tokenizer:
    """Text <-> token ids for one model folder.

    Attributes:
        special_tokens_map: named special token -> text, only the ones set (chat templates read these).
        bos_token_id, eos_token_id: ids of the named bos/eos tokens, or None.
        stop_token_ids: ids that end generation (generation_config.json's eos list, see module doc).
        vocab_size: number of valid ids, added tokens included (ids are 0..vocab_size-1).
    """

    def __init__(self, backend: HFTokenizer, tokenizer_config: dict, special_tokens_map_file: dict | None = None,
                 generation_config: dict | None = None, model_config: dict | None = None):
        self._tok = backend
        config = dict(tokenizer_config)
        # Legacy special_tokens_map.json only counts when the config has no added_tokens_decoder (transformers 5).
        if "added_tokens_decoder" not in config and special_tokens_map_file:
            for key, value in special_tokens_map_file.items():
                if key == "additional_special_tokens":
                    key = "extra_special_tokens"
                config[key] = value
        if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
            config["extra_special_tokens"] = config.pop("additional_special_tokens")

        self._named = {k: _token_content(config.get(k)) for k in NAMED_SPECIAL_TOKENS}
        self._named = {k: v for k, v in self._named.items() if v is not None}
        extra = config.get("extra_special_tokens") or []
        # A dict of model-specific tokens ({"image_token": "<image>"}) is as special as a list of them.
        extra_values = list(extra.values()) if isinstance(extra, dict) else list(extra)
        self._add_missing_tokens(config.get("added_tokens_decoder") or {}, config, extra_values)
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))

        self.special_tokens_map: dict[str, str] = dict(self._named)
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self.token_to_id(self._named.get("bos_token"))
        self.eos_token_id = self.token_to_id(self._named.get("eos_token"))
        self.stop_token_ids: tuple[int, ...] = self._resolve_stop_ids(generation_config, model_config)
        self.all_special_ids: frozenset[int] = frozenset(
            i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load folder/tokenizer.json plus the JSON configs next to it (each optional but tokenizer.json)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the decoder needs a tokenizers-format tokenizer.json")
        return cls(HFTokenizer.from_file(str(path)), read_json(folder / "tokenizer_config.json"),
                   read_json(folder / "special_tokens_map.json"), read_json(folder / "generation_config.json"),
                   read_json(folder / "config.json"))

    def _add_missing_tokens(self, added_tokens_decoder: dict, config: dict, extra_values: list) -> None:
        # transformers re-adds every entry of tokenizer_config's added_tokens_decoder, then adds each named or
        # extra special token that is not already an added token; we do the same so ids and skipping agree.
        entries = sorted(((int(i), v) for i, v in added_tokens_decoder.items()), key=lambda kv: kv[0])
        for _, value in entries:
            self._tok.add_tokens([_as_added_token(value, special=bool(value.get("special", False)))])
        present = {tok.content for tok in self._tok.get_added_tokens_decoder().values()}
        for value in [config.get(k) for k in NAMED_SPECIAL_TOKENS] + extra_values:
            content = _token_content(value)
            if content is not None and content not in present:
                self._tok.add_tokens([_as_added_token(value, special=True)])
                present.add(content)

    def _resolve_stop_ids(self, generation_config: dict | None, model_config: dict | None) -> tuple[int, ...]:
        # GenerationConfig: generation_config.json wins; without one, from_model_config reads config.json,
        # descending into a decoder/text config for composite models.
        ids: list[int] = []
        if generation_config and "eos_token_id" in generation_config:
            ids = _eos_ids(generation_config["eos_token_id"])
        elif model_config:
            source = model_config
            for name in ("decoder", "generator", "text_config"):
                if isinstance(model_config.get(name), dict) and model_config.get("eos_token_id") is None:
                    source = model_config[name]
                    break
            ids = _eos_ids(source.get("eos_token_id"))
        if not ids and self.eos_token_id is not None:
            ids = [self.eos_token_id]
        return tuple(dict.fromkeys(ids))

    @property
    def bos_token(self) -> str | None:
        return self._named.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._named.get("eos_token")

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (read-only use: the detokenizer decodes through it)."""
        return self._tok

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """text -> ids [T]. add_special_tokens runs tokenizer.json's post-processor (e.g. a leading bos)."""
        if not isinstance(text, str):
            raise InvalidArgument(f"text to encode must be a string, got {type(text).__name__}", param="prompt")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_leading(self, text: str, limit: int, add_special_tokens: bool = True) -> tuple[list[int], bool]:
        """(ids, whole): text's ids (whole True), or, for a text certainly longer than limit tokens, the ids of
        a prefix of it, at least limit of them (services/common/token_budget.py), without tokenizing the rest.
        Through encode_batch, which lets go of the GIL: run off the event loop, it does not hold it up."""
        if not isinstance(text, str):
            raise InvalidArgument(f"text to encode must be a string, got {type(text).__name__}", param="prompt")

        def encode(part: str) -> list[int]:
            return self._tok.encode_batch([part], add_special_tokens=add_special_tokens)[0].ids
        ids, end = leading_ids(encode, text, limit)
        return ids, end == len(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """ids [T] -> text. Byte-level pieces that do not form whole UTF-8 characters become U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def validate_ids(self, ids: Iterable, limit: int | None = None, param: str = "prompt") -> list[int]:
        """Check user-given ids: ints in [0, limit) where limit defaults to vocab_size; returns them as a list.

        The engine may pass the model's embedding rows as limit when that is smaller than the tokenizer's vocab.
        Raises InvalidArgument naming the first bad id.
        """
        bound = self.vocab_size if limit is None else min(limit, self.vocab_size)
        out = []
        for pos, tid in enumerate(ids):
            # bool is an int subclass; True as a token id is a client bug, not id 1.
            if isinstance(tid, bool) or not isinstance(tid, int):
                raise InvalidArgument(f"token id at position {pos} is not an integer: {tid!r}", param=param)
            if not 0 <= tid < bound:
                raise InvalidArgument(f"token id {tid} at position {pos} is outside the vocabulary [0, {bound})",
                                      param=param)
            out.append(tid)
        return out
