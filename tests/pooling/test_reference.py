"""Reference tests: our embeddings and scores against sentence-transformers / transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from services.common.plan import ExecutionPlan
from services.pooling.folder import read_spec
from services.pooling.model import Embedder, Reranker, Sequence
from services.pooling.packed import PackedBert
from tests.common.test_tile_unit import needs_amx
from tests.pooling.conftest import MINILM_SHAPE, TINY_SHAPE
from tests.tolerance import assert_close, assert_cosine

# Floating-point comparisons: run again under the second kernel dispatch (Makefile).
pytestmark = pytest.mark.numerics

TEXTS = ["A man is eating food.", "Hi", "The new movie is awesome and I would watch it again tomorrow.",
         "Ünïcode, punctuation!? and   spaces", "x " * 40]


def embed(model: Embedder, texts, truncate=False) -> torch.Tensor:
    return model.forward(model.tokenize(texts, truncate))


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return Embedder(read_spec(minilm_dir, kind="embedding"))


@pytest.fixture(scope="module")
def minilm_st(minilm_dir):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(minilm_dir), device="cpu")


# The packed forward's fast paths pinned every way (services/common/plan.py), whatever the timing would pick.
PLANS = ["linear=plain,encoder_attention=torch", "linear=packed,encoder_attention=cpp"]


@pytest.mark.parametrize("fast_paths", PLANS)
@pytest.mark.parametrize("which", ["tiny_bert_dir", "tiny_st_dir"])
def test_tiny_bert_matches_sentence_transformers(which, request, fast_paths):
    from sentence_transformers import SentenceTransformer
    folder = request.getfixturevalue(which)
    spec = read_spec(folder, kind="embedding")
    # The plain folder gets ST's defaults (mean, no normalise); the ST folder declares CLS + Normalize.
    assert (spec.pooling, spec.normalize) == (("mean", False) if which == "tiny_bert_dir" else ("cls", True))
    model = Embedder(spec, fast_paths=fast_paths)
    assert model.plan.chosen("encoder_attention") == fast_paths.rsplit("=", 1)[1]
    ours = embed(model, TEXTS)
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=2)
    assert ours.shape == ref.shape
    assert_cosine(ours, ref, **TINY_SHAPE)


def test_packed_forward_equals_transformers(minilm):
    assert minilm.packed is not None
    seqs = minilm.tokenize(TEXTS, truncate=False)
    packed_hidden, mask = minilm.packed(seqs)
    batch = minilm._batch(seqs)
    with torch.inference_mode():
        hf_hidden = minilm.module(**batch).last_hidden_state
    visible = mask.unsqueeze(-1)
    assert_close(packed_hidden * visible, hf_hidden * visible, **MINILM_SHAPE)


def test_packed_only_wraps_plain_bert(tiny_llama_dir):
    from transformers import AutoModel
    assert PackedBert.wrap(AutoModel.from_pretrained(tiny_llama_dir), ExecutionPlan()) is None


def test_minilm_matches_sentence_transformers(minilm, minilm_st):
    ours = embed(minilm, TEXTS)
    ref = minilm_st.encode(TEXTS, batch_size=32)
    assert_cosine(ours, ref, **MINILM_SHAPE)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "transformers"])
def test_minilm_bfloat16_within_the_bf16_bound_of_sentence_transformers_fp32(minilm_dir, minilm_st, gensim_data,
                                                                             packed):
    """--dtype bfloat16 (weights and activations, pooling in fp32), through the packed forward and through
    transformers' (--no-packed), against the fp32 reference, short texts and the 50 Lee documents (truncated at
    256 tokens, both sides), bounded by tests/tolerance.py for bf16 at MiniLM's shape: cosine >= 0.99399.
    Measured on an AMD EPYC: 0.99990 (transformers), 0.99993 (packed, 256 Lee sentences)."""
    from services.pooling.config import PoolingConfig
    from services.pooling.server import load_models
    [(spec, model)] = load_models(PoolingConfig(embedding_model=str(minilm_dir), dtype="bfloat16", packed=packed))
    assert next(model.module.parameters()).dtype == torch.bfloat16 and (model.packed is not None) == packed
    texts = TEXTS + _lee_documents(gensim_data)
    ours = embed(model, texts, truncate=True)
    assert ours.dtype == torch.float32 and ours.shape == (len(texts), spec.hidden_size)
    assert_cosine(ours, minilm_st.encode(texts, batch_size=32), dtype=torch.bfloat16, **MINILM_SHAPE,
                  what="bf16 vs sentence-transformers fp32")


@needs_amx
def test_minilm_split_products_within_their_bound_of_sentence_transformers(minilm_dir, minilm_st, gensim_data):
    """--matmul-precision high with the split products pinned on (every projection of the packed forward on the
    tile unit, services/common/split_products.py) against sentence-transformers' fp32, short texts and the 50 Lee
    documents, within the split products' bound at MiniLM's shape."""
    from services.pooling.config import PoolingConfig
    from services.pooling.server import load_models
    [(_, model)] = load_models(PoolingConfig(embedding_model=str(minilm_dir), matmul_precision="high",
                                             fast_paths="split_products=on"))
    assert model.packed is not None and model.plan.chosen("split_products 1152x384+b") == "on rows>=1"
    texts = TEXTS + _lee_documents(gensim_data)
    assert_cosine(embed(model, texts, truncate=True), minilm_st.encode(texts, batch_size=32), split=True,
                  **MINILM_SHAPE, what="split products vs sentence-transformers fp32")


def test_batched_equals_single(minilm):
    batched = embed(minilm, TEXTS)
    for i, text in enumerate(TEXTS):
        single = embed(minilm, [text])[0]
        assert_close(batched[i], single, **MINILM_SHAPE, what=f"text {i}")


def _lee_documents(gensim_data) -> list[str]:
    lines = (gensim_data / "lee.cor").read_text(encoding="latin-1").splitlines()
    docs = [line.strip() for line in lines if line.strip()]
    assert len(docs) == 50
    return docs


def _lee_human(gensim_data) -> np.ndarray:
    """similarities0-1.txt: a 50x50 matrix of mean human scores (lower triangle zero);
    the pairs are its upper triangle."""
    matrix = np.loadtxt(gensim_data / "similarities0-1.txt")
    assert matrix.shape == (50, 50)
    return matrix[np.triu_indices(50, k=1)]


def test_lee50_quality_equals_sentence_transformers(minilm, minilm_st, gensim_data):
    docs, human = _lee_documents(gensim_data), _lee_human(gensim_data)
    upper = np.triu_indices(50, k=1)
    # Lee documents exceed MiniLM's 256 tokens; both sides truncate (ST always does, we on request).
    ours = embed(minilm, docs, truncate=True)
    ref = torch.as_tensor(minilm_st.encode(docs, batch_size=32))
    ours_cos, ref_cos = (ours @ ours.T).double().numpy()[upper], (ref @ ref.T).double().numpy()[upper]
    assert_close(ours_cos, ref_cos, **MINILM_SHAPE)
    pearson_ours = np.corrcoef(ours_cos, human)[0, 1]
    pearson_ref = np.corrcoef(ref_cos, human)[0, 1]
    assert pearson_ref > 0.5                      # the data and its format are understood
    # Pearson's r is the cosine of the centred vectors: moving x by e turns x - mean(x) by an angle
    # whose sine is at most |e| / |x - mean(x)|, so r moves by at most twice that.
    moved = np.linalg.norm(ours_cos - ref_cos) / np.linalg.norm(ref_cos - ref_cos.mean())
    assert abs(pearson_ours - pearson_ref) <= 2 * moved


def test_cross_encoder_matches_sentence_transformers(tiny_reranker_dir):
    from sentence_transformers import CrossEncoder
    model = Reranker(read_spec(tiny_reranker_dir, kind="rerank"))
    assert model.spec.activation == "sigmoid"
    query, docs = "what is a panda?", ["The giant panda is a bear.", "Paris is in France.", "hi"]
    raw = model.forward(model.tokenize(query, docs, truncate=False))
    ref = CrossEncoder(str(tiny_reranker_dir), device="cpu")
    ref_scores = ref.predict([(query, d) for d in docs])
    ref_raw = ref.predict([(query, d) for d in docs], activation_fn=torch.nn.Identity())
    assert_close(model.activate(raw), ref_scores, **TINY_SHAPE)
    assert_close(raw, ref_raw, **TINY_SHAPE)
    # The pair uses the tokenizer's own template: [CLS] q [SEP] d [SEP] with segment ids 0/1.
    seq = model.tokenize(query, docs[:1], truncate=False)[0]
    assert seq.ids[0] == 101 and seq.ids.count(102) == 2 and set(seq.type_ids) == {0, 1}


def test_reranker_without_trained_head_is_refused(tmp_path, tiny_bert_dir):
    """A BertModel checkpoint relabelled as a classifier would get a random head: refuse it."""
    import json
    import shutil
    folder = tmp_path / "headless"
    shutil.copytree(tiny_bert_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"},
               label2id={"LABEL_0": 0})
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="refusing random initialisation"):
        Reranker(read_spec(folder, kind="rerank"))


def test_reranker_with_two_labels_is_refused(tmp_path, tiny_reranker_dir):
    import json
    import shutil
    folder = tmp_path / "two-labels"
    shutil.copytree(tiny_reranker_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(id2label={"0": "A", "1": "B"}, label2id={"A": 0, "B": 1})
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="one score label"):
        read_spec(folder, kind="rerank")


def test_decoder_as_embedder_last_pooling(tiny_llama_dir):
    from transformers import AutoModel
    spec = read_spec(tiny_llama_dir, kind="embedding", normalize=True)
    assert spec.causal and spec.pooling == "last"
    model = Embedder(spec)
    ids = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    ours = model.forward([Sequence(tuple(row)) for row in ids])    # right-padded batch
    ref_model = AutoModel.from_pretrained(tiny_llama_dir).eval()
    with torch.inference_mode():
        ref = torch.stack([ref_model(input_ids=torch.tensor([row])).last_hidden_state[0, -1] for row in ids])
    assert_close(ours, F.normalize(ref, dim=-1), **TINY_SHAPE)

