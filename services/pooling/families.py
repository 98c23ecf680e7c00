"""The model families the pooling service serves, by config.json's model_type.

A family here is one whose embeddings (and, where `rerank`, cross-encoder scores) the tests prove equal to
sentence-transformers on tiny random checkpoints (tests/pooling/test_families.py). Anything else is refused at
load in one line naming model_type: transformers would load many more, but an unproven family may compute
something else and still look successful (docs/design.md, invariant 8).

Which forward runs is not decided here: the packed forward says which encoders it computes exactly
(packed.unsupported), and every other family runs transformers' own forward, the reference.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What the service knows of a model_type beyond its config."""

    model_type: str
    causal: bool            # a decoder backbone: causal attention, last-token pooling unless the folder says
    rerank: bool            # its *ForSequenceClassification is served as a cross-encoder


FAMILIES = {f.model_type: f for f in (
    Family("bert", causal=False, rerank=True),
    # RoBERTa's embeddings: positions count from pad_token_id + 1 and skip pad tokens.
    Family("roberta", causal=False, rerank=True),
    Family("xlm-roberta", causal=False, rerank=True),
    # Alternating global and sliding-window attention, RoPE, GeGLU, no biases.
    Family("modernbert", causal=False, rerank=False),
    Family("llama", causal=True, rerank=False),
    Family("qwen2", causal=True, rerank=False),
    Family("qwen3", causal=True, rerank=False),
)}


def family(config: dict, folder: object, kind: str) -> Family:
    """The Family of a folder's config.json for `kind` ("embedding" | "rerank"); ValueError in one line."""
    model_type = config.get("model_type")
    found = FAMILIES.get(model_type)
    if found is None:
        raise ValueError(f"{folder}: config.json model_type {model_type!r} is not a family the pooling service "
                         f"serves ({', '.join(FAMILIES)})")
    if kind == "rerank" and not found.rerank:
        raise ValueError(f"{folder}: config.json model_type {model_type!r} is not served as a reranker "
                         f"(rerankers: {', '.join(f.model_type for f in FAMILIES.values() if f.rerank)})")
    return found
