"""What a local model folder declares: kind, pooling, normalisation, limits, activation.

Reads config.json and, when present, the sentence-transformers files
(modules.json, <pooling>/config.json, a Normalize module, sentence_bert_config.json,
config_sentence_transformers.json). Anything the folder declares that tessera
cannot honour exactly is refused at start: computing something else would look
successful and be wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .families import family
from .pooling import MODES

# sentence-transformers pooling names -> ours; other modes (max, weightedmean...) are refused.
_ST_POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                      "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
                      "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens": "weightedmean"}
# Activations a cross-encoder folder may declare (torch class name -> ours).
ACTIVATIONS = ("sigmoid", "identity", "tanh")


@dataclass(frozen=True)
class ModelSpec:
    """A served model, resolved from its folder plus flags."""

    path: Path
    name: str
    kind: str                      # "embedding" | "rerank"
    model_type: str                # config.json's, one of families.FAMILIES
    causal: bool                   # decoder backbone (causal attention)
    pooling: str                   # mean | cls | last (embeddings only)
    normalize: bool
    max_model_len: int
    lowercase: bool                # sentence_bert_config do_lower_case
    matryoshka: tuple[int, ...]
    activation: str                # rerank only: sigmoid | identity | tanh
    vocab_size: int
    hidden_size: int


def _read(path: Path) -> dict | list | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _st_pooling(folder: Path, modules: list) -> tuple[str | None, bool]:
    """(pooling mode or None, has Normalize) from a modules.json list."""
    pooling, normalize = None, False
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            cfg = _read(folder / module.get("path", "") / "config.json") or {}
            modes = cfg.get("pooling_mode")
            if modes is None:
                modes = [m for key, m in _ST_LEGACY_POOLING.items() if cfg.get(key)]
            modes = [modes] if isinstance(modes, str) else list(modes)
            if len(modes) != 1 or modes[0] not in _ST_POOLING:
                raise ValueError(f"{folder}: sentence-transformers pooling {modes} is not supported "
                                 f"(only one of {sorted(_ST_POOLING)})")
            pooling = _ST_POOLING[modes[0]]
        else:
            raise ValueError(f"{folder}: sentence-transformers module {module.get('type')!r} is not "
                             "supported; tessera would compute a different embedding")
    return pooling, normalize


def _activation(folder: Path, config: dict) -> str:
    """sentence-transformers' CrossEncoder rule (6.x): config_sentence_transformers.json
    activation_fn, else config.json sentence_transformers.activation_fn, else the legacy
    sbert_ce_default_activation_function, else sigmoid for one label."""
    st_cfg = _read(folder / "config_sentence_transformers.json") or {}
    path = (st_cfg.get("activation_fn") or (config.get("sentence_transformers") or {}).get("activation_fn")
            or config.get("sbert_ce_default_activation_function"))
    if path is None:
        return "sigmoid"
    name = path.rsplit(".", 1)[-1].lower()
    if not path.startswith("torch.") or name not in ACTIVATIONS:
        raise ValueError(f"{folder}: declared activation {path!r} is not one tessera can apply "
                         f"(torch {', '.join(ACTIVATIONS)})")
    return name


def _context_limit(folder: Path, config: dict) -> int:
    limits = []
    if config.get("max_position_embeddings"):
        # RoBERTa-style embeddings start counting at pad_token_id + 1.
        offset = config.get("pad_token_id", 1) + 1 if "roberta" in config.get("model_type", "") else 0
        limits.append(int(config["max_position_embeddings"]) - offset)
    st_limit = (_read(folder / "sentence_bert_config.json") or {}).get("max_seq_length")
    if st_limit:
        limits.append(int(st_limit))
    tok_limit = (_read(folder / "tokenizer_config.json") or {}).get("model_max_length")
    if isinstance(tok_limit, int) and tok_limit < 1_000_000:
        limits.append(tok_limit)
    if not limits:
        raise ValueError(f"{folder}: cannot tell the context length; pass --max-model-len")
    return min(limits)


def check(cfg) -> None:
    """The folders a PoolingConfig names, read before anything starts (services/common/process.py): every
    refusal read_spec makes, without loading a weight."""
    read_spec(cfg.embedding_model, kind="embedding", pooling=cfg.pooling, normalize=cfg.normalize,
              max_model_len=cfg.max_model_len)
    if cfg.reranker_model:
        read_spec(cfg.reranker_model, kind="rerank", max_model_len=cfg.max_model_len)


def read_spec(folder: str | Path, *, name: str = "", kind: str, pooling: str = "",
              normalize: bool | None = None, max_model_len: int = 0) -> ModelSpec:
    """Resolve a folder into a ModelSpec. kind is what the flag asked for ("embedding" or
    "rerank"); flags fill in only what the folder leaves open and may not contradict it."""
    folder = Path(folder).resolve()
    config = _read(folder / "config.json")
    if config is None:
        raise ValueError(f"{folder}: no config.json")
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{folder}: no tokenizer.json (a fast tokenizer file is required)")
    if not list(folder.glob("*.safetensors")):
        raise ValueError(f"{folder}: no *.safetensors weights")
    served = family(config, folder, kind)     # an unknown model_type is refused here, in one line
    archs = config.get("architectures") or []
    is_classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if kind == "rerank" and not is_classifier:
        raise ValueError(f"{folder}: a reranker must be a *ForSequenceClassification folder, got {archs}")
    if kind == "embedding" and is_classifier:
        raise ValueError(f"{folder}: {archs} is a cross-encoder; serve it with --reranker-model")
    causal = served.causal or bool(config.get("is_decoder"))

    st_pooling, st_normalize = None, None
    modules = _read(folder / "modules.json")
    if modules is not None and kind == "embedding":
        st_pooling, st_normalize = _st_pooling(folder, modules)
    if st_pooling and pooling and pooling != st_pooling:
        raise ValueError(f"{folder}: the folder declares {st_pooling} pooling, the flag says {pooling}")
    if st_normalize is not None and normalize is not None and normalize != st_normalize:
        raise ValueError(f"{folder}: the folder declares normalize={st_normalize}, the flag says {normalize}")
    pooling = st_pooling or pooling or ("last" if causal else "mean")
    if pooling not in MODES:
        raise ValueError(f"pooling must be one of {MODES}")
    normalize = st_normalize if st_normalize is not None else bool(normalize)

    st_cfg = _read(folder / "config_sentence_transformers.json") or {}
    if st_cfg.get("default_prompt_name"):
        raise ValueError(f"{folder}: default prompts are not supported (the vectors would differ)")
    matryoshka = tuple(sorted(int(d) for d in (st_cfg.get("matryoshka_dimensions")
                                                or config.get("matryoshka_dimensions") or ())))

    limit = _context_limit(folder, config)
    if max_model_len > limit:
        raise ValueError(f"{folder}: max_model_len {max_model_len} exceeds the model's {limit}")
    activation = ""
    if kind == "rerank":
        labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
        if labels != 1:
            raise ValueError(f"{folder}: a reranker needs one score label, the folder has {labels}")
        activation = _activation(folder, config)
    text_cfg = config.get("text_config") or config
    return ModelSpec(
        path=folder, name=name or folder.name, kind=kind, model_type=config["model_type"], causal=causal,
        pooling=pooling, normalize=normalize, max_model_len=max_model_len or limit,
        lowercase=bool((_read(folder / "sentence_bert_config.json") or {}).get("do_lower_case")),
        matryoshka=matryoshka, activation=activation,
        vocab_size=int(text_cfg["vocab_size"]), hidden_size=int(text_cfg["hidden_size"]))
