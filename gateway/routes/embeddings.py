"""POST /v1/embeddings in OpenAI's shape, served by the pooling service's Embed."""
from __future__ import annotations

import base64
import time
from typing import Annotated, Literal

import torch
from fastapi import APIRouter, Request, Response
from pydantic import Field, PlainValidator, WithJsonSchema, model_validator

from services.common.errors import Internal, TesseraError
from services.common.pb import pooling_pb2
from services.common.tensors import from_proto

from ..backends import EMBEDDING
from ..counts import check_counts
from ..errors import request_id
from ..limits import bill
from .common import (
    ERROR_RESPONSES,
    INT32_MAX,
    TEXT_OR_TOKENS,
    TEXT_OR_TOKENS_SCHEMA,
    StrictBody,
    as_batch,
    catalog,
    check_text_or_tokens,
)

router = APIRouter()

_INPUT_SCHEMA = {**TEXT_OR_TOKENS_SCHEMA,
                 "description": f"{TEXT_OR_TOKENS}; the batch bound and context length are the model's"}


class EmbeddingRequest(StrictBody):
    input: Annotated[object, PlainValidator(check_text_or_tokens), WithJsonSchema(_INPUT_SCHEMA)]
    model: str | None = Field(None, description="a model from /v1/models; omitted: the served embedding model")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector as little-endian float32 bytes")
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX,
                                   description="refused unless the model was trained for that size (Matryoshka)")
    user: str | None = Field(None, description="accepted for OpenAI compatibility; not used")
    truncate: bool = Field(False, description="extension: cut over-length inputs to the model's context length"
                                             " instead of refusing them")

    @model_validator(mode="before")
    @classmethod
    def _counted(cls, data):
        return check_counts(data, EMBEDDING)    # before anything is validated (gateway/counts.py)


def to_inputs(value) -> list[pooling_pb2.EmbedInput]:
    """OpenAI `input` -> EmbedInput list; `[]` stays empty so the service refuses the empty batch."""
    return [pooling_pb2.EmbedInput(text=x) if isinstance(x, str) else
            pooling_pb2.EmbedInput(tokens=pooling_pb2.TokenIds(ids=x)) for x in as_batch(value)]


TRACE_HEADER = "x-tessera-trace"
_TIMELINE = ("received", "queued", "forward_start", "forward_end", "resumed", "replied")


def trace_header(request: Request, timeline: pooling_pb2.Timeline, sent: int, replied: int) -> str:
    """One call's stage stamps as `name=ns,...` (CLOCK_MONOTONIC ns; gateway_* here, the rest in the
    pooling service), in the order they happened."""
    stamps = {"gateway_received": request.scope["state"]["received_ns"], "gateway_sent": sent,
              **{name: getattr(timeline, f"{name}_ns") for name in _TIMELINE},
              "gateway_replied": replied, "gateway_encoded": time.monotonic_ns(),
              "batch_size": timeline.batch_size}
    return ",".join(f"{k}={v}" for k, v in stamps.items())


@router.post("/v1/embeddings", tags=["embeddings"], responses=ERROR_RESPONSES)
async def create_embeddings(body: EmbeddingRequest, request: Request, response: Response) -> dict:
    """Embed a text, a batch of texts, or token ids; float lists or base64 float32."""
    model = await catalog(request).resolve(body.model, EMBEDDING)
    rid = request_id(request)
    inputs = to_inputs(body.input)
    traced = request.app.state.config.trace_requests and request.headers.get(TRACE_HEADER) == "1"
    req = pooling_pb2.EmbedRequest(model=model.name, inputs=inputs, truncate=body.truncate, request_id=rid,
                                   trace=traced)
    if body.dimensions is not None:
        req.dimensions = body.dimensions
    backend = model.backend
    sent = time.monotonic_ns()
    reply = await backend.call(backend.pooling.Embed, req, rid, fields={"inputs": "input"})
    replied = time.monotonic_ns()
    try:
        vectors = from_proto(reply.embeddings, dtype=torch.float32, shape=(len(inputs), None), name="embeddings")
    except TesseraError as exc:
        # A malformed answer is the backend's bug, not the caller's mistake.
        raise Internal(f"{backend.name} answered a malformed embedding tensor: {exc.message}") from None
    rows = vectors.numpy().astype("<f4", copy=False)
    if body.encoding_format == "float":
        data = rows.tolist()
    else:
        data = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    usage = reply.usage
    bill(request, usage.prompt_tokens)
    answer = {"object": "list", "model": reply.model or model.name,
              "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(data)],
              "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens}}
    if traced:
        response.headers[TRACE_HEADER] = trace_header(request, reply.timeline, sent, replied)
    return answer
