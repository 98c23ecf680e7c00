"""Loaded models: tokenise and validate requests, run one padded forward per batch.

`Embedder.forward` and `Reranker.forward` run in the batcher's worker thread; the
rest runs on the event loop and raises typed errors for bad input.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from services.common import dtypes
from services.common.errors import ContextLengthExceeded, InvalidArgument
from services.common.plan import POOLING as POOLING_PATHS
from services.common.plan import ExecutionPlan, Pins
from services.common.token_budget import leading_prefix

from . import packed
from .folder import ModelSpec
from .pooling import pool_hidden

log = logging.getLogger("tessera.pooling.model")

@dataclass(frozen=True)
class Sequence:
    """One row of a forward: token ids and, for pair encoders, their segment ids."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.ids)


def _load_tokenizers(spec: ModelSpec) -> tuple[Tokenizer, Tokenizer]:
    """(untruncated, truncating at max_model_len) copies of the folder's tokenizer.json.

    The file's own padding/truncation settings are dropped: batching pads, and
    over-length input is an error unless the request opts into truncation. Two copies
    because a Tokenizer's truncation is shared mutable state.
    """
    path = str(spec.path / "tokenizer.json")
    full, cut = Tokenizer.from_file(path), Tokenizer.from_file(path)
    for tok in (full, cut):
        tok.no_padding()
        tok.no_truncation()
    cut.enable_truncation(spec.max_model_len, strategy="longest_first")
    return full, cut


def _check_missing(spec: ModelSpec, info: dict, allowed: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint that leaves weights at random init (transformers would just warn)."""
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(allowed))
    if missing:
        raise ValueError(f"{spec.path}: checkpoint lacks trained weights for {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}; refusing random initialisation")


class _Base:
    """Shared loading, tokenisation, validation and padding."""

    # The fast paths chosen at load (services/common/plan.py): none for transformers' own forward,
    # unless a subclass runs a faster one.
    plan = ExecutionPlan()

    def __init__(self, spec: ModelSpec, module: torch.nn.Module, dtype: str):
        self.spec = spec
        self.module = module.to(dtypes.to_torch(dtype, ('fp32', 'bf16'))).eval()
        self.full, self.cut = _load_tokenizers(spec)
        params = inspect.signature(self.module.forward).parameters
        self.takes_type_ids = "token_type_ids" in params

    def _check_length(self, seq: Sequence, param: str, truncate: bool) -> Sequence:
        if len(seq) > self.spec.max_model_len:
            if not truncate:
                raise ContextLengthExceeded(
                    f"{param} has {len(seq)} tokens, over the model's {self.spec.max_model_len}; "
                    "shorten it or set truncate", param=param)
            n = self.spec.max_model_len
            seq = Sequence(seq.ids[:n], seq.type_ids[:n] if seq.type_ids else None)
        return seq

    def _leading(self, text: str, param: str, truncate: bool) -> str:
        """text, or for one certainly over max_model_len tokens a word-boundary prefix with the same first ids
        (services/common/token_budget.py), found without tokenizing the rest: refused unless truncate, where
        the prefix truncates to what text would. Blocking: the servicer runs tokenize on a worker thread."""
        found = leading_prefix(self._ids, text, self.spec.max_model_len + 1)
        if found is None:
            return text
        if not truncate:
            raise ContextLengthExceeded(
                f"{param} has at least {len(found[0])} tokens, over the model's {self.spec.max_model_len}; "
                "shorten it or set truncate", param=param)
        return text[:found[1]]

    def _ids(self, text: str) -> list[int]:
        """text's ids without special tokens, through encode_batch, which lets go of the GIL."""
        return self.full.encode_batch([text], add_special_tokens=False)[0].ids

    def _batch(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        """Right-padded input_ids / attention_mask (/ token_type_ids) [B, L]."""
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        types = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, seq in enumerate(seqs):
            n = len(seq)
            ids[row, :n] = torch.tensor(seq.ids)
            mask[row, :n] = 1
            if seq.type_ids:
                types[row, :n] = torch.tensor(seq.type_ids)
        batch = {"input_ids": ids, "attention_mask": mask}
        if self.takes_type_ids:
            batch["token_type_ids"] = types
        return batch


def _reference_forward(plan: ExecutionPlan, why_not: str) -> None:
    """Record (and log) that transformers' forward runs and why; a fast path pinned for the packed forward
    does not apply to this model, said at WARNING (one pin can serve a fleet of models)."""
    pinned = [f"{p}={plan.pinned(p)}" for p in ("linear", "encoder_attention") if plan.pinned(p) != "auto"]
    plan.record("forward", "transformers",
                reason=why_not + (f"; pinned {', '.join(pinned)}: not applicable to this model" if pinned else ""),
                level=logging.WARNING if pinned else logging.INFO)


class Embedder(_Base):
    """An encoder or decoder backbone (AutoModel) plus our pooling."""

    def __init__(self, spec: ModelSpec, *, dtype: str = "fp32", fast: bool = True,
                 fast_paths: str | Pins | None = None, matmul_precision: str = "highest"):
        from transformers import AutoModel
        module, info = AutoModel.from_pretrained(spec.path, dtype=torch.float32,
                                                 output_loading_info=True)
        # BERT-style pooler heads are never used by our pooling.
        _check_missing(spec, info, allowed=("pooler.",))
        super().__init__(spec, module, dtype)
        # bf16 too: its matmuls run ~2x fp32's where the CPU has AVX-512 bf16 (linear_path times them), and the
        # packed forward's bf16 result is as close to fp32 as transformers' own bf16 forward is
        # (tests/pooling/test_reference.py), at ~0.6x its CPU time on MiniLM.
        # Its fast paths, chosen at load under what --fast-paths pins (services/common/plan.py).
        self.plan = ExecutionPlan(fast_paths, POOLING_PATHS)
        why_not = packed.unsupported(self.module)
        why_not = "packed forward off (--no-packed)" if not fast else \
            why_not and f"packed forward not for {spec.model_type}: {why_not}"
        self.packed = None if why_not else packed.PackedBert(self.module, self.plan, matmul_precision)
        if why_not:
            _reference_forward(self.plan, why_not)
        log.info("embedding model %s: %s (%s) pooling=%s normalize=%s max_len=%d fast=%s fast paths: %s",
                 spec.name, type(self.module).__name__, spec.model_type, spec.pooling, spec.normalize,
                 spec.max_model_len, self.packed is not None, self.plan.summary())

    def tokenize(self, inputs: list[str | list[int]], truncate: bool) -> list[Sequence]:
        """Validate and tokenise request inputs (text, or token ids) in order."""
        texts = {}
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                if not item:
                    raise InvalidArgument(f"inputs[{i}] is an empty string", param=f"inputs[{i}]")
                texts[i] = self._leading(item.lower() if self.spec.lowercase else item, f"inputs[{i}]", truncate)
        tok = self.cut if truncate else self.full
        encoded = dict(zip(texts, tok.encode_batch(list(texts.values())), strict=True))
        seqs = []
        for i, item in enumerate(inputs):
            if i in encoded:
                seq = Sequence(tuple(encoded[i].ids))
            else:
                seq = Sequence(tuple(self._check_ids(item, f"inputs[{i}]")))
            seqs.append(self._check_length(seq, f"inputs[{i}]", truncate))
        return seqs

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise InvalidArgument(f"{param} has no token ids", param=param)
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise InvalidArgument(f"{param}: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.spec.vocab_size})", param=param)
        return ids

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """[B] sequences -> pooled float32 [B, H] (full width; Matryoshka cut is per request)."""
        if self.packed is not None:
            hidden, mask = self.packed(seqs)
        else:
            batch = self._batch(seqs)
            hidden, mask = self.module(**batch).last_hidden_state, batch["attention_mask"]
        return pool_hidden(hidden, mask, self.spec.pooling, self.spec.normalize)


class Reranker(_Base):
    """A one-label *ForSequenceClassification cross-encoder."""

    def __init__(self, spec: ModelSpec, *, dtype: str = "fp32"):
        from transformers import AutoModelForSequenceClassification
        module, info = AutoModelForSequenceClassification.from_pretrained(
            spec.path, dtype=torch.float32, output_loading_info=True)
        if module.config.num_labels != 1:
            raise ValueError(f"{spec.path}: a reranker needs one label, not {module.config.num_labels}")
        _check_missing(spec, info)
        super().__init__(spec, module, dtype)
        self.plan = ExecutionPlan()
        self.plan.record("forward", "transformers", reason="the packed forward serves embedding models only")
        log.info("reranker %s: %s (%s) activation=%s max_len=%d", spec.name, type(self.module).__name__,
                 spec.model_type, spec.activation, spec.max_model_len)

    def tokenize(self, query: str, documents: list[str], truncate: bool) -> list[Sequence]:
        """One (query, document) pair per document, with the tokenizer's own pair template."""
        if not query:
            raise InvalidArgument("query is empty", param="query")
        for i, doc in enumerate(documents):
            if not doc:
                raise InvalidArgument(f"documents[{i}] is an empty string", param=f"documents[{i}]")
        tok = self.cut if truncate else self.full
        lower = str.lower if self.spec.lowercase else str
        # Each side is cut before the pairs are tokenized: the query is repeated once per document. Where
        # both sides of a pair exceed the context, longest_first gives the odd token to the side with more
        # ids, judged on the two prefixes.
        query = self._leading(lower(query), "query", truncate)
        encoded = tok.encode_batch([(query, self._leading(lower(doc), f"documents[{i}]", truncate))
                                    for i, doc in enumerate(documents)])
        return [self._check_length(Sequence(tuple(e.ids), tuple(e.type_ids)), f"documents[{i}]", truncate)
                for i, e in enumerate(encoded)]

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """[B] pairs -> raw head outputs float32 [B]."""
        return self.module(**self._batch(seqs)).logits.float().reshape(len(seqs))

    def activate(self, scores: torch.Tensor) -> torch.Tensor:
        """The activation the folder declares (sentence-transformers' CrossEncoder rule)."""
        if self.spec.activation == "sigmoid":
            return torch.sigmoid(scores)
        if self.spec.activation == "tanh":
            return torch.tanh(scores)
        return scores
