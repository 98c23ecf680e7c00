"""tessera.pooling.v1.PoolingService over the loaded models and their batchers."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from services.common import tensors
from services.common.errors import InvalidArgument, ModelNotFound, TesseraError, Unavailable, Unsupported, grpc_errors
from services.common.pb import common_pb2, pooling_pb2, pooling_pb2_grpc

from .batcher import Batcher, Span
from .folder import ModelSpec
from .metrics import PoolingMetrics
from .pooling import shorten

SERVICE_NAME = "tessera.pooling.v1.PoolingService"
_KINDS = {"embedding": pooling_pb2.MODEL_KIND_EMBEDDING, "rerank": pooling_pb2.MODEL_KIND_RERANK}


@dataclass
class Served:
    """One model as served: its spec, runner (Embedder or Reranker) and batcher."""

    spec: ModelSpec
    runner: object
    batcher: Batcher


class _Timer:
    """Observe one call's latency, labelled with its outcome (OK or the error reason)."""

    def __init__(self, metrics: PoolingMetrics, rpc: str):
        self.metrics, self.rpc = metrics, rpc

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, kind, exc, tb):
        code = "OK" if exc is None else exc.reason if isinstance(exc, TesseraError) else "INTERNAL"
        self.metrics.latency.labels(self.rpc, code).observe(time.perf_counter() - self.start)


class PoolingServicer(pooling_pb2_grpc.PoolingServiceServicer):
    def __init__(self, metrics: PoolingMetrics, max_request_inputs: int):
        self.metrics = metrics
        self.max_request_inputs = max_request_inputs
        self.models: dict[str, Served] = {}       # filled once loading finishes
        self.defaults: dict[str, str] = {}        # kind -> model name

    def _model(self, name: str, kind: str) -> Served:
        if not self.models:
            raise Unavailable("models are still loading")
        if not name:
            if kind not in self.defaults:
                raise ModelNotFound("no reranker is configured", param="model")
            return self.models[self.defaults[kind]]
        served = self.models.get(name)
        if served is None:
            raise ModelNotFound(f"model {name!r} is not served here (serving {sorted(self.models)})",
                                param="model")
        if served.spec.kind != kind:
            other = "Rerank" if served.spec.kind == "rerank" else "Embed"
            raise InvalidArgument(f"model {name!r} is a {served.spec.kind} model; call {other} instead",
                                  param="model")
        return served

    def _check_count(self, count: int, field: str) -> None:
        if count == 0:
            raise InvalidArgument(f"{field} is empty", param=field)
        if count > self.max_request_inputs:
            raise InvalidArgument(f"{field} has {count} items, over the limit of {self.max_request_inputs}",
                                  param=field)

    @grpc_errors
    async def Embed(self, request, context):
        received = time.monotonic_ns()
        with _Timer(self.metrics, "Embed"):
            served = self._model(request.model, "embedding")
            spec = served.spec
            self._check_count(len(request.inputs), "inputs")
            if request.HasField("dimensions") and not (
                    request.dimensions in spec.matryoshka
                    or (spec.matryoshka and request.dimensions == spec.hidden_size)):
                raise Unsupported(
                    f"dimensions={request.dimensions} is refused: {spec.name} is trained for "
                    f"{list(spec.matryoshka) or 'no reduced sizes'} (its full width is {spec.hidden_size})",
                    param="dimensions")
            inputs = []
            for i, item in enumerate(request.inputs):
                which = item.WhichOneof("kind")
                if which is None:
                    raise InvalidArgument(f"inputs[{i}] has neither text nor tokens", param=f"inputs[{i}]")
                inputs.append(item.text if which == "text" else list(item.tokens.ids))
            # Off the event loop: a long input must not hold up other calls (tokenize cuts it first).
            seqs = await asyncio.to_thread(served.runner.tokenize, inputs, request.truncate)
            queued, span = time.monotonic_ns(), Span()
            vectors = torch.stack(await served.batcher.submit(seqs, span))
            resumed = time.monotonic_ns()
            if request.HasField("dimensions"):
                vectors = shorten(vectors, request.dimensions, spec.normalize)
            tokens = sum(len(s) for s in seqs)
            reply = pooling_pb2.EmbedResponse(
                model=spec.name, embeddings=tensors.to_proto(vectors.float()),
                usage=common_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens))
            if request.trace:
                reply.timeline.CopyFrom(pooling_pb2.Timeline(
                    received_ns=received, queued_ns=queued, forward_start_ns=span.start_ns,
                    forward_end_ns=span.end_ns, resumed_ns=resumed, replied_ns=time.monotonic_ns(),
                    batch_size=span.batch_size))
            return reply

    @grpc_errors
    async def Rerank(self, request, context):
        with _Timer(self.metrics, "Rerank"):
            served = self._model(request.model, "rerank")
            count = len(request.documents)
            self._check_count(count, "documents")
            top_n = request.top_n if request.HasField("top_n") else count
            if not 1 <= top_n <= count:
                raise InvalidArgument(f"top_n must be between 1 and {count} (the number of documents), "
                                      f"got {top_n}", param="top_n")
            seqs = await asyncio.to_thread(served.runner.tokenize, request.query, list(request.documents),
                                           request.truncate)
            scores = torch.stack(await served.batcher.submit(seqs))
            if not request.raw_scores:
                scores = served.runner.activate(scores)
            values = scores.tolist()
            order = sorted(range(count), key=lambda i: (-values[i], i))[:top_n]
            tokens = sum(len(s) for s in seqs)
            return pooling_pb2.RerankResponse(
                model=served.spec.name,
                results=[pooling_pb2.RerankResult(index=i, relevance_score=values[i]) for i in order],
                usage=common_pb2.Usage(prompt_tokens=tokens, total_tokens=tokens))

    @grpc_errors
    async def GetModelInfo(self, request, context):
        return pooling_pb2.GetModelInfoResponse(models=[
            pooling_pb2.ModelInfo(
                name=s.spec.name, kind=_KINDS[s.spec.kind], max_model_len=s.spec.max_model_len,
                dimensions=s.spec.hidden_size if s.spec.kind == "embedding" else 0,
                pooling=s.spec.pooling if s.spec.kind == "embedding" else "",
                normalize=s.spec.normalize, matryoshka_dimensions=list(s.spec.matryoshka),
                max_batch_size=self.max_request_inputs, activation=s.spec.activation,
                execution_plan=s.runner.plan.to_proto())
            for s in self.models.values()])
