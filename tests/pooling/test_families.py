"""The pooling service's families against sentence-transformers on tiny random checkpoints: XLM-RoBERTa and
RoBERTa embeddings (packed forward pinned every way, and off) and cross-encoder scores, Qwen3 and Qwen2
decoders with last-token pooling and a ModernBERT encoder (transformers' forward, with the reason in the plan); and the
one-line refusal of a model_type the service does not serve."""
from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.pooling.folder import read_spec
from services.pooling.model import Embedder, Reranker, Sequence
from tests.pooling import checkpoints
from tests.pooling.checkpoints import SHAPE
from tests.tolerance import assert_close, assert_cosine

pytestmark = pytest.mark.numerics

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["A man is eating food.", "Hi", "The new movie is awesome and I would watch it again tomorrow.",
         "Ünïcode, punctuation!? and   spaces", "x " * 40]
# The packed forward's paths pinned every way, and the packed forward off (transformers' forward).
PLANS = [("linear=plain,encoder_attention=torch", True), ("linear=packed,encoder_attention=cpp", True),
         (None, False)]


@pytest.fixture(scope="module", params=["xlm-roberta", "roberta"])
def xlmr_dir(tmp_path_factory, request) -> Path:
    """An XLM-RoBERTa (and a RoBERTa) sentence-transformers folder: mean pooling, Normalize."""
    source = checkpoints.write_xlm_roberta(tmp_path_factory.mktemp(f"{request.param}-hf"), model_type=request.param)
    return checkpoints.write_sentence_transformer(source, tmp_path_factory.mktemp(f"{request.param}-st"), "mean")


@pytest.fixture(scope="module", params=["xlm-roberta", "roberta"])
def xlmr_reranker_dir(tmp_path_factory, request) -> Path:
    return checkpoints.write_xlm_roberta_reranker(tmp_path_factory.mktemp(f"{request.param}-reranker"),
                                                  model_type=request.param)


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def qwen3_dir(tmp_path_factory, request) -> Path:
    """A Qwen3 (and a Qwen2) decoder as a sentence-transformers folder: last-token pooling, Normalize."""
    source = checkpoints.write_qwen3(tmp_path_factory.mktemp(f"{request.param}-hf"), model_type=request.param)
    return checkpoints.write_sentence_transformer(source, tmp_path_factory.mktemp(f"{request.param}-st"),
                                                  "lasttoken")


@pytest.fixture(scope="module")
def modernbert_dir(tmp_path_factory) -> Path:
    source = checkpoints.write_modernbert(tmp_path_factory.mktemp("modernbert-hf"))
    return checkpoints.write_sentence_transformer(source, tmp_path_factory.mktemp("modernbert-st"), "mean")


def embed(model: Embedder, texts) -> torch.Tensor:
    return model.forward(model.tokenize(texts, truncate=False))


def reference(folder: Path, texts) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    return torch.as_tensor(SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=2))


@pytest.mark.parametrize("fast_paths, fast", PLANS, ids=["plain-torch", "packed-cpp", "no-packed"])
def test_xlm_roberta_embeddings_match_sentence_transformers(xlmr_dir, fast_paths, fast):
    spec = read_spec(xlmr_dir, kind="embedding")
    assert spec.model_type in ("xlm-roberta", "roberta")
    assert (spec.pooling, spec.normalize, spec.causal) == ("mean", True, False)
    model = Embedder(spec, fast=fast, fast_paths=fast_paths)
    assert (model.packed is not None) == fast
    if fast:
        assert model.plan.chosen("encoder_attention") == fast_paths.rsplit("=", 1)[1]
    else:
        assert model.plan.get("forward").reason == "packed forward off (--no-packed)"
    ours = embed(model, TEXTS)
    assert_cosine(ours, reference(xlmr_dir, TEXTS), **SHAPE)


@pytest.mark.parametrize("cpp", [False, True], ids=["grouped-sdpa", "cpp"])
def test_packed_xlm_roberta_positions_skip_pad_tokens_as_transformers_does(xlmr_dir, cpp):
    """RoBERTa positions count from pad_token_id + 1 and give a pad token inside a row (token ids a caller
    sends may hold one) the pad position: the packed forward equals XLMRobertaModel's padded forward."""
    model = Embedder(read_spec(xlmr_dir, kind="embedding"), fast_paths=f"encoder_attention={'cpp' if cpp else 'torch'}")
    pad = model.module.config.pad_token_id
    assert pad == 1
    rows = [[0, 50, 51, 52, 2], [0, 60, pad, pad, 61, 62, 63, 2], [0, 70, 2]]
    seqs = [Sequence(tuple(r)) for r in rows]
    hidden, mask = model.packed(seqs)
    batch = model._batch(seqs)
    with torch.inference_mode():
        ref = model.module(**batch).last_hidden_state
    visible = mask.unsqueeze(-1)
    assert_close(hidden * visible, ref * visible, **SHAPE)


def test_xlm_roberta_cross_encoder_matches_sentence_transformers(xlmr_reranker_dir):
    from sentence_transformers import CrossEncoder
    model = Reranker(read_spec(xlmr_reranker_dir, kind="rerank"))
    assert model.spec.model_type in ("xlm-roberta", "roberta") and model.spec.activation == "sigmoid"
    query, docs = "what is a panda?", ["The giant panda is a bear.", "Paris is in France.", "hi"]
    seqs = model.tokenize(query, docs, truncate=False)
    # XLM-R's pair template: <s> q </s> </s> d </s> (one byte token each), one segment.
    n = len("what is a panda?")
    ids = seqs[2].ids
    assert (len(ids), ids[0], ids[n + 1:n + 3], ids[-1]) == (n + 6, 0, (2, 2), 2) and set(seqs[2].type_ids) == {0}
    raw = model.forward(seqs)
    ref = CrossEncoder(str(xlmr_reranker_dir), device="cpu")
    pairs = [(query, d) for d in docs]
    assert_close(raw, ref.predict(pairs, activation_fn=torch.nn.Identity()), **SHAPE)
    assert_close(model.activate(raw), ref.predict(pairs), **SHAPE)


# A family the packed forward does not compute runs transformers' forward whatever is pinned, and says why.
PINS = [None, "linear=packed,encoder_attention=cpp"]


@pytest.mark.parametrize("fast_paths", PINS, ids=["auto", "pinned"])
def test_qwen3_last_token_embeddings_match_sentence_transformers(qwen3_dir, fast_paths, caplog):
    spec = read_spec(qwen3_dir, kind="embedding")
    assert spec.model_type in ("qwen3", "qwen2")
    assert (spec.pooling, spec.normalize, spec.causal) == ("last", True, True)
    with caplog.at_level(logging.INFO, logger="tessera.plan"):
        model = Embedder(spec, fast_paths=fast_paths)
    _assert_reference_forward(model, "Qwen3Model" if spec.model_type == "qwen3" else "Qwen2Model", fast_paths,
                              caplog)
    # The folder's tokenizer appends <|endoftext|>, whose hidden state is the embedding; sentence-transformers
    # pads on the left (as Qwen3-Embedding does), we on the right: the last real token is the same either way.
    ids = model.tokenize(["Hi"], truncate=False)[0].ids
    assert len(ids) == 3 and ids[-1] == model.module.config.eos_token_id == 256
    ours = embed(model, TEXTS)
    assert_cosine(ours, reference(qwen3_dir, TEXTS), **SHAPE)


@pytest.mark.parametrize("fast_paths", PINS, ids=["auto", "pinned"])
def test_modernbert_embeddings_match_sentence_transformers(modernbert_dir, fast_paths, caplog):
    spec = read_spec(modernbert_dir, kind="embedding")
    assert (spec.model_type, spec.pooling, spec.causal) == ("modernbert", "mean", False)
    with caplog.at_level(logging.INFO, logger="tessera.plan"):
        model = Embedder(spec, fast_paths=fast_paths)
    _assert_reference_forward(model, "ModernBertModel", fast_paths, caplog)
    cfg = model.module.config
    assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    lengths = [len(s) for s in model.tokenize(TEXTS, truncate=False)]
    assert max(lengths) > 4 * cfg.local_attention     # the local layers' window cuts the longer rows
    ours = embed(model, TEXTS)
    assert_cosine(ours, reference(modernbert_dir, TEXTS), **SHAPE)


def _assert_reference_forward(model: Embedder, module: str, fast_paths, caplog) -> None:
    assert model.packed is None
    choice = model.plan.get("forward")
    assert choice.chosen == "transformers"
    assert f"packed forward not for {model.spec.model_type}: it computes BertModel, RobertaModel, XLMRobertaModel " \
           f"only, not {module}" in choice.reason
    [record] = [r for r in caplog.records if "fast path forward: transformers" in r.getMessage()]
    assert record.levelno == (logging.WARNING if fast_paths else logging.INFO)
    assert ("not applicable to this model" in choice.reason) == bool(fast_paths)


def _relabel(source: Path, folder: Path, **changes) -> Path:
    shutil.copytree(source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_family_not_served_is_refused_in_one_line_naming_model_type(tmp_path, tiny_bert_dir, tiny_llama_dir):
    with pytest.raises(ValueError, match=r"config.json model_type 'gpt2' is not a family the pooling service "
                                         r"serves \(bert, roberta, xlm-roberta, modernbert, llama, qwen2, qwen3\)$"):
        read_spec(_relabel(tiny_bert_dir, tmp_path / "gpt2", model_type="gpt2"), kind="embedding")
    classifier = _relabel(tiny_llama_dir, tmp_path / "llama-cls", architectures=["LlamaForSequenceClassification"],
                          id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    with pytest.raises(ValueError, match=r"model_type 'llama' is not served as a reranker \(rerankers: bert, "
                                         r"roberta, xlm-roberta\)$"):
        read_spec(classifier, kind="rerank")


def test_the_service_refuses_an_unknown_family_in_one_line(tmp_path, tiny_bert_dir):
    folder = _relabel(tiny_bert_dir, tmp_path / "mystery", model_type="mystery")
    done = subprocess.run([sys.executable, "-m", "services.pooling", "--embedding-model", str(folder),
                           "--host", "127.0.0.1", "--port", "0"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={k: v for k, v in os.environ.items() if not k.startswith("TESSERA_POOLING")})
    # Refused before start-up (services/common/process.py): a usage error, one line on stderr.
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.json model_type 'mystery' is not a family" in lines[0], done.stderr[-2000:]


def test_the_docs_table_lists_the_registry():
    """docs/models.md's pooling families table names every family the registry serves, and which cross-encode."""
    from services.pooling.families import FAMILIES
    text = (ROOT / "docs" / "models.md").read_text().split("## Pooling families", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")]
    assert {row[0].strip("`"): row[2] == "yes" for row in rows} == {t: f.rerank for t, f in FAMILIES.items()}


def test_served_over_grpc_as_a_user_calls_them(qwen3_dir, xlmr_reranker_dir):
    """A Qwen3 embedder and an XLM-R cross-encoder in one pooling service: Embed and Rerank equal
    sentence-transformers, and GetModelInfo reports which forward each runs."""
    import grpc
    from sentence_transformers import CrossEncoder

    from services.common import tensors
    from services.common.pb import pooling_pb2 as pb
    from services.common.pb import pooling_pb2_grpc
    from tests.pooling.conftest import RunningServer
    running = RunningServer(embedding_model=str(qwen3_dir), embedding_name="qwen3",
                            reranker_model=str(xlmr_reranker_dir), reranker_name="xlmr-rerank")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            reply = stub.Embed(pb.EmbedRequest(model="qwen3", inputs=[pb.EmbedInput(text=t) for t in TEXTS]),
                               timeout=60)
            assert_cosine(tensors.from_proto(reply.embeddings), reference(qwen3_dir, TEXTS), **SHAPE)
            query, docs = "what is a panda?", ["Paris is in France.", "The giant panda is a bear.", "hi"]
            ranked = stub.Rerank(pb.RerankRequest(model="xlmr-rerank", query=query, documents=docs), timeout=60)
            scores = torch.as_tensor(CrossEncoder(str(xlmr_reranker_dir), device="cpu").predict(
                [(query, d) for d in docs]))
            order = [r.index for r in ranked.results]
            assert sorted(order) == [0, 1, 2]
            assert_close([r.relevance_score for r in ranked.results], scores[order], **SHAPE)
            assert all(a.relevance_score >= b.relevance_score for a, b in itertools.pairwise(ranked.results))
            models = {m.name: m for m in stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).models}
            [choice] = models["qwen3"].execution_plan.choices
            assert (choice.name, choice.chosen) == ("forward", "transformers") and "qwen" in choice.reason
            assert (models["qwen3"].pooling, models["qwen3"].normalize) == ("last", True)
    finally:
        running.close()


def _assert_bfloat16_within_bound(folder: Path, fast: bool, packed: bool) -> None:
    """--dtype bfloat16 (weights and activations, pooling in fp32) through the forward the family runs, against
    sentence-transformers fp32, bounded by tests/tolerance.py for bf16 at the families' shape."""
    model = Embedder(read_spec(folder, kind="embedding"), dtype="bf16", fast=fast,
                     fast_paths="linear=plain,encoder_attention=torch")
    assert next(model.module.parameters()).dtype == torch.bfloat16 and (model.packed is not None) == packed
    ours = embed(model, TEXTS)
    assert ours.dtype == torch.float32
    assert_cosine(ours, reference(folder, TEXTS), dtype=torch.bfloat16, **SHAPE, what="bf16 vs fp32")


@pytest.mark.parametrize("fast", [True, False], ids=["packed", "transformers"])
def test_roberta_bfloat16_within_the_bf16_bound(xlmr_dir, fast):
    _assert_bfloat16_within_bound(xlmr_dir, fast, packed=fast)


def test_decoder_bfloat16_within_the_bf16_bound(qwen3_dir):
    _assert_bfloat16_within_bound(qwen3_dir, True, packed=False)


def test_modernbert_bfloat16_within_the_bf16_bound(modernbert_dir):
    _assert_bfloat16_within_bound(modernbert_dir, True, packed=False)
