"""POST /v1/rerank (aliases /rerank, /v2/rerank) in the Cohere/Jina shape, served by the pooling service's Rerank."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import Field, PlainValidator, WithJsonSchema, model_validator

from services.common.errors import Internal
from services.common.pb import pooling_pb2

from ..backends import RERANK
from ..counts import check_counts
from ..errors import request_id
from ..limits import bill
from .common import ERROR_RESPONSES, INT32_MAX, StrictBody, catalog

router = APIRouter()


def _check_documents(value) -> list[str]:
    """Documents as strings or {"text": str} objects -> their texts."""
    if not isinstance(value, list):
        raise ValueError("must be an array of strings or of {\"text\": string} objects")
    texts = []
    for i, doc in enumerate(value):
        if isinstance(doc, dict) and set(doc) == {"text"}:
            doc = doc["text"]
        if not isinstance(doc, str):
            raise ValueError(f"item {i} must be a string or a {{\"text\": string}} object")
        texts.append(doc)
    return texts


_DOCUMENTS_SCHEMA = {"type": "array", "items": {"anyOf": [
    {"type": "string"},
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
     "additionalProperties": False},
]}}


class RerankRequest(StrictBody):
    query: str
    documents: Annotated[list[str], PlainValidator(_check_documents), WithJsonSchema(_DOCUMENTS_SCHEMA)]
    model: str | None = Field(None, description="a reranker from /v1/models; omitted: the served reranker")
    top_n: int | None = Field(None, ge=1, le=INT32_MAX, description="return the best top_n (<= len(documents));"
                                                                    " omitted: all")
    return_documents: bool = Field(True, description="include each document's text in its result")
    raw_scores: bool = Field(False, description="extension: skip the activation the model declares")
    truncate: bool = Field(False, description="extension: cut over-length pairs instead of refusing them")

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, data):
        return check_counts(data, RERANK)    # before anything is validated (gateway/counts.py)


@router.post("/v1/rerank", tags=["rerank"], responses=ERROR_RESPONSES)
@router.post("/v2/rerank", tags=["rerank"], responses=ERROR_RESPONSES)
@router.post("/rerank", tags=["rerank"], responses=ERROR_RESPONSES)
async def rerank(body: RerankRequest, request: Request) -> dict:
    """Score each document against the query with a cross-encoder; results sorted by descending score."""
    model = await catalog(request).resolve(body.model, RERANK)
    rid = request_id(request)
    req = pooling_pb2.RerankRequest(model=model.name, query=body.query, documents=body.documents,
                                    raw_scores=body.raw_scores, truncate=body.truncate, request_id=rid)
    if body.top_n is not None:
        req.top_n = body.top_n
    backend = model.backend
    reply = await backend.call(backend.pooling.Rerank, req, rid)
    results = []
    for r in reply.results:
        if not 0 <= r.index < len(body.documents):
            raise Internal(f"{backend.name} answered document index {r.index} of {len(body.documents)}")
        result = {"index": r.index, "relevance_score": r.relevance_score}
        if body.return_documents:
            result["document"] = {"text": body.documents[r.index]}
        results.append(result)
    usage = reply.usage
    bill(request, usage.prompt_tokens)
    return {"id": f"rerank-{rid}", "model": reply.model or model.name, "results": results,
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens}}
