"""Long inputs cost what the model can use of them: a 12 MB embedding input is refused (or, with truncate,
cut) from its first kilobytes, off the event loop, while a small call beside it answers promptly; rerank
cuts the query and each document before pairing them (services/common/token_budget.py)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.common import tensors
from services.common.errors import REASON_KEY
from services.common.pb import pooling_pb2, pooling_pb2_grpc
from tests.pooling.conftest import TINY_SHAPE, RunningServer
from tests.tolerance import assert_close

pb = pooling_pb2
HUGE = "word " * 2_400_000          # 12 MB; the tiny models take 64 (embedding) and 128 (reranker) tokens


@pytest.fixture(scope="module")
def stub(tiny_st_dir, tiny_reranker_dir):
    running = RunningServer(embedding_model=str(tiny_st_dir), embedding_name="tiny-embed",
                            reranker_model=str(tiny_reranker_dir), reranker_name="tiny-rerank")
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)
    running.close()


def embed(stub, texts, truncate=False):
    return stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts], truncate=truncate),
                      timeout=30)


def refused(call) -> tuple[str, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return dict(info.value.trailing_metadata() or ()).get(REASON_KEY), info.value.details()


def test_a_twelve_megabyte_input_is_judged_at_once_and_a_small_call_beside_it_answers(stub):
    embed(stub, ["warm up"])
    with ThreadPoolExecutor(2) as pool:
        started = time.perf_counter()
        big = pool.submit(refused, lambda: embed(stub, ["short", HUGE]))
        small = []
        while not big.done():
            t0 = time.perf_counter()
            embed(stub, ["a small call"])
            small.append(time.perf_counter() - t0)
        reason, details = big.result()
        took = time.perf_counter() - started
    assert reason == "CONTEXT_LENGTH" and "inputs[1] has at least" in details and "over the model's 64" in details
    assert took < 2.0 and max(small, default=0) < 1.0, (took, small)
    started = time.perf_counter()
    reply = embed(stub, [HUGE], truncate=True)
    assert time.perf_counter() - started < 2.0
    assert reply.usage.prompt_tokens == 64
    same = embed(stub, ["word " * 200], truncate=True)     # what truncation keeps of HUGE
    assert_close(tensors.from_proto(reply.embeddings), tensors.from_proto(same.embeddings), **TINY_SHAPE)


def test_rerank_cuts_the_query_and_each_document_before_pairing(stub):
    docs = ["pandas eat bamboo", HUGE, "word word word"]
    started = time.perf_counter()
    reply = stub.Rerank(pb.RerankRequest(query=HUGE, documents=docs, truncate=True, raw_scores=True), timeout=30)
    assert time.perf_counter() - started < 3.0
    cut = "word " * 400                     # over the reranker's 128 tokens, as HUGE is
    want = stub.Rerank(pb.RerankRequest(query=cut, documents=["pandas eat bamboo", cut, "word word word"],
                                        truncate=True, raw_scores=True), timeout=30)
    assert reply.usage.prompt_tokens == want.usage.prompt_tokens == 3 * 128
    got = {r.index: r.relevance_score for r in reply.results}
    assert_close([got[i] for i in range(3)], [{r.index: r.relevance_score for r in want.results}[i]
                                              for i in range(3)], **TINY_SHAPE)
    reason, details = refused(lambda: stub.Rerank(pb.RerankRequest(query="q", documents=["d", HUGE]), timeout=30))
    assert reason == "CONTEXT_LENGTH" and "documents[1] has at least" in details, details
    reason, details = refused(lambda: stub.Rerank(pb.RerankRequest(query=HUGE, documents=["d"]), timeout=30))
    assert reason == "CONTEXT_LENGTH" and "query has at least" in details, details
