"""The gateway's backends: one gRPC channel per configured service, its health, and model discovery.

`Backend` wraps one HOST:PORT (a channel, its stubs, grpc.health.v1, and a count
of calls in flight). `Catalog` asks every model-serving backend's GetModelInfo
which models it serves (and, for a decoder, the request limits it judges by),
caches the answer for `model_refresh_s`, and resolves a request's `model` to
what that name is. A name may be served by several replicas; which of them a
call goes to is chosen once, by gateway/routing.py.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.auth import call_metadata, read_token
from services.common.errors import InvalidArgument, ModelNotFound, TesseraError, Unavailable, from_rpc_error
from services.common.pb import (
    decoder_pb2,
    decoder_pb2_grpc,
    pooling_pb2,
    pooling_pb2_grpc,
    vision_pb2,
    vision_pb2_grpc,
)
from services.common.tls import channel_credentials

from .config import GatewayConfig

log = logging.getLogger("tessera.gateway.backends")

# role -> the full gRPC service name, which is also the name its health is reported under.
HEALTH_NAMES = {
    "pooling": pooling_pb2.DESCRIPTOR.services_by_name["PoolingService"].full_name,
    "decoder": decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"].full_name,
    "vision": vision_pb2.DESCRIPTOR.services_by_name["VisionService"].full_name,
}

EMBEDDING, RERANK, GENERATION = "embedding", "rerank", "generation"
_POOLING_KINDS = {pooling_pb2.MODEL_KIND_EMBEDDING: EMBEDDING, pooling_pb2.MODEL_KIND_RERANK: RERANK}
# Where each kind of model is used, for "wrong endpoint" messages.
ENDPOINTS = {EMBEDDING: "/v1/embeddings", RERANK: "/v1/rerank", GENERATION: "/v1/chat/completions or /v1/completions"}
NO_MODEL_OF_KIND = {
    GENERATION: "no language model is configured: start the gateway with --decoder HOST:PORT",
    EMBEDDING: "no embedding model is configured: start the pooling service with --embedding-model DIR",
    RERANK: "no reranker is configured: start the pooling service with --reranker-model DIR"
            " (make up: RERANKER_MODEL=DIR make up)",
}


class Backend:
    """One gRPC service at one address. Open the channel inside the event loop that will use it."""

    def __init__(self, role: str, address: str, cfg: GatewayConfig):
        self.role = role
        self.address = address
        self.health_name = HEALTH_NAMES[role]
        self.cfg = cfg
        self.in_flight = 0
        self.channel: grpc.aio.Channel | None = None
        # Sent with every call; the services refuse calls without it (services/common/auth.py).
        self.auth = call_metadata(read_token(cfg.backend_token_file) if cfg.backend_token_file else None)

    def metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        """A call's metadata: its request id and the backend token."""
        return (("x-request-id", request_id), *self.auth)

    @property
    def label(self) -> str:
        return f"{self.role}@{self.address}"

    def open(self) -> None:
        limit = self.cfg.max_message_mb * 1024 * 1024
        # gRPC's reconnect backoff grows to 120 s by default: after a long outage a restarted service would sit
        # unused for up to two minutes. 5 s bounds how long the gateway takes to notice it is back.
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                   ("grpc.max_reconnect_backoff_ms", 5000)]
        if self.cfg.tls_ca:
            if self.cfg.tls_server_name:
                options.append(("grpc.ssl_target_name_override", self.cfg.tls_server_name))
            creds = channel_credentials(self.cfg.tls_ca, self.cfg.tls_client_cert, self.cfg.tls_client_key)
            self.channel = grpc.aio.secure_channel(self.address, creds, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(self.address, options=options)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        if self.role == "pooling":
            self.pooling = pooling_pb2_grpc.PoolingServiceStub(self.channel)
        elif self.role == "decoder":
            self.decoder = decoder_pb2_grpc.DecoderServiceStub(self.channel)
        elif self.role == "vision":
            self.vision = vision_pb2_grpc.VisionServiceStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def health(self) -> str:
        """SERVING, NOT_SERVING, ... or 'UNREACHABLE (<reason>)'."""
        try:
            reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=self.health_name),
                                                 timeout=self.cfg.health_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"UNREACHABLE ({exc.code().name}: {exc.details()})"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def _typed(self, exc: grpc.aio.AioRpcError, fields: dict[str, str] | None) -> TesseraError:
        """The typed error of a failed call; fields renames proto field names to the HTTP body's
        (e.g. inputs -> input) in the error's param, which names the top-level field only
        ("inputs[3]" -> "input"; the message keeps the detail)."""
        err = from_rpc_error(exc)
        if err.reason == "UNAVAILABLE":
            err = Unavailable(f"{self.label}: {err.message}", param=err.param)
        if err.param:
            head = re.split(r"[\[.]", err.param, maxsplit=1)[0]
            err.param = (fields or {}).get(head, head)
        return err

    async def call(self, method, request, request_id: str, fields: dict[str, str] | None = None):
        """Await a unary RPC with the per-call deadline; a failed call raises its typed error."""
        self.in_flight += 1
        try:
            return await method(request, timeout=self.cfg.grpc_timeout_s,
                                metadata=self.metadata(request_id))
        except grpc.aio.AioRpcError as exc:
            raise self._typed(exc, fields) from None
        finally:
            self.in_flight -= 1

    async def stream(self, method, request, request_id: str, fields: dict[str, str] | None = None,
                     ) -> AsyncIterator:
        """Iterate a server-streaming RPC under the whole-generation deadline; a failure raises its typed error.

        Closing the iterator early (the HTTP client left, a sibling call failed) cancels the call, which
        makes the decoder abort the request and free its blocks; close it with contextlib.aclosing or
        aclose(), never by dropping it.
        """
        self.in_flight += 1
        call = method(request, timeout=self.cfg.generate_timeout_s, metadata=self.metadata(request_id))
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as exc:
            raise self._typed(exc, fields) from None
        finally:
            call.cancel()  # a no-op once the call has ended
            self.in_flight -= 1

    async def models(self) -> list[Model]:
        """The models this backend serves, from its GetModelInfo (vision serves none by name)."""
        if self.role == "decoder":
            info = await self.call(self.decoder.GetModelInfo, decoder_pb2.GetModelInfoRequest(), "model-discovery")
            base = Model(info.name, GENERATION, self, {
                "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                "has_chat_template": info.has_chat_template, "supports_images": info.supports_images,
                "dtype": info.dtype, "max_loras": info.max_loras, "max_lora_rank": info.max_lora_rank,
                # Adapters nobody registered are loaded by name on their first request (--lora-on-demand).
                "lora_on_demand": info.lora_on_demand,
                # The format tool_choice "auto" is parsed in; None: the decoder has auto tool choice off.
                "tool_call_parser": info.tool_call_parser or None,
                # n-gram speculative decoding's settings; None: off.
                "speculative": MessageToDict(info.speculative_decoding, preserving_proto_field_name=True)
                if info.HasField("speculative_decoding") else None,
                # Weight-only quantization, e.g. "int8: 211 of 211 linears"; None: the --dtype weights.
                "quantization": None if info.quantization in ("", "none") else info.quantization},
                limits=info.limits)
            # Each registered LoRA adapter is a model of its own name (vLLM's convention), run on this base.
            listed = await self.call(self.decoder.ListAdapters, decoder_pb2.ListAdaptersRequest(), "model-discovery")
            return [base, *(Model(a.name, GENERATION, self, {**base.extra, "rank": a.rank,
                                                              "target_modules": list(a.target_modules)},
                                  parent=info.name, limits=info.limits) for a in listed.adapters)]
        if self.role != "pooling":
            return []
        reply = await self.call(self.pooling.GetModelInfo, pooling_pb2.GetModelInfoRequest(), "model-discovery")
        found = []
        for info in reply.models:
            kind = _POOLING_KINDS.get(info.kind)
            if kind is None:
                log.warning("%s reports model %r of unknown kind %d; not routed", self.label, info.name, info.kind)
                continue
            extra = {"max_model_len": info.max_model_len, "max_batch_size": info.max_batch_size}
            if kind == EMBEDDING:
                extra |= {"dimensions": info.dimensions, "pooling": info.pooling, "normalize": info.normalize,
                          "matryoshka_dimensions": list(info.matryoshka_dimensions)}
            else:
                extra["activation"] = info.activation
            found.append(Model(info.name, kind, self, extra))
        return found


@dataclass(frozen=True)
class Model:
    """A servable model name, the backend serving it, and what /v1/models shows about it."""

    name: str
    kind: str
    backend: Backend = field(compare=False)
    extra: dict = field(default_factory=dict, compare=False)
    parent: str | None = field(default=None, compare=False)  # a LoRA adapter: the base model it runs on
    # A generation model's request limits as its decoder publishes them (the decoder's rulebook); None for
    # the pooling service's models. The gateway checks images against these, never numbers of its own.
    limits: decoder_pb2.RequestLimits | None = field(default=None, compare=False)

    def target(self) -> dict[str, str]:
        """GenerateRequest's model and adapter fields: an adapter runs as its base model plus the adapter."""
        if self.parent is None:
            return {"model": self.name, "adapter": ""}
        return {"model": self.parent, "adapter": self.name}


def build_backends(cfg: GatewayConfig) -> list[Backend]:
    """One Backend per configured address, in flag order."""
    backends = [Backend("pooling", cfg.pooling, cfg)] if cfg.pooling else []
    backends += [Backend("decoder", address, cfg) for address in cfg.decoder]
    if cfg.vision:
        backends.append(Backend("vision", cfg.vision, cfg))
    return backends


def _unambiguous(by_name: dict[str, list[Model]]) -> dict[str, list[Model]]:
    """by_name without adapter names that would route ambiguously: an adapter named like a served model, or one
    name registered on two different base models. The models keep their names; such adapters are not routed
    (a warning says why) until they are renamed."""
    out = {}
    for name, replicas in by_name.items():
        parents = {m.parent for m in replicas}
        if len(parents) > 1:
            log.warning("adapter name %r is ambiguous (served as %s); it is not routed until renamed", name,
                        sorted(p or "a model" for p in parents))
            replicas = [m for m in replicas if m.parent is None]
        if replicas:
            out[name] = replicas
    return out


class Catalog:
    """Model name -> replicas, discovered from the backends and refreshed when stale or on a miss."""

    # A miss refreshes at most this often, so unknown names cannot hammer the backends.
    MISS_REFRESH_S = 1.0

    def __init__(self, backends: list[Backend], refresh_s: float):
        self.backends = backends
        self.refresh_s = refresh_s
        self.by_name: dict[str, list[Model]] = {}
        self.failures: dict[str, str] = {}  # backend label -> why discovery failed
        self.refreshed_at = float("-inf")
        self._lock = asyncio.Lock()

    async def refresh(self, max_age: float) -> None:
        """Ask every backend again unless the last answer is younger than max_age seconds."""
        async with self._lock:
            if time.monotonic() - self.refreshed_at < max_age:
                return
            results = await asyncio.gather(*(b.models() for b in self.backends), return_exceptions=True)
            by_name: dict[str, list[Model]] = {}
            failures = {}
            for backend, result in zip(self.backends, results, strict=True):
                if isinstance(result, TesseraError):
                    failures[backend.label] = result.message if result.message.startswith(backend.label) \
                        else f"{backend.label}: {result.message}"
                    continue
                if isinstance(result, BaseException):
                    raise result
                for model in result:
                    by_name.setdefault(model.name, []).append(model)
            self.by_name, self.failures = _unambiguous(by_name), failures
            # A failed discovery is retried on the next request, not trusted for refresh_s.
            self.refreshed_at = time.monotonic() if not failures else float("-inf")
            if failures:
                log.warning("model discovery failed for %s", failures)

    def _unavailable(self, what: str) -> Unavailable:
        # Each failure message already starts with its backend's label.
        return Unavailable(f"{what}; " + "; ".join(self.failures.values()))

    async def models(self) -> list[Model]:
        """Every served model, one entry per name; Unavailable when a backend could not be asked."""
        await self.refresh(self.refresh_s)
        if self.failures:
            raise self._unavailable("cannot list every model")
        return [replicas[0] for replicas in self.by_name.values()]

    def _on_demand(self, name: str) -> list[Model] | None:
        """An unlisted name as an adapter of the one base model whose decoders load adapters by name
        (--lora-on-demand); its decoder answers NOT_FOUND when there is no such folder. None when no base
        model, or more than one (the name would be ambiguous), does."""
        bases = [r for r in self.by_name.values() if r[0].parent is None and r[0].extra.get("lora_on_demand")]
        if len(bases) != 1:
            return None
        base = bases[0][0]
        return [Model(name, GENERATION, base.backend, base.extra, parent=base.name, limits=base.limits)]

    async def resolve(self, name: str | None, kind: str) -> Model:
        """What a request's `model` names (None: the first model of that kind). Every replica of a name
        describes it alike; which replica a generation call goes to is gateway/routing.py's choice."""
        await self.refresh(self.refresh_s)
        if name is not None and name not in self.by_name:
            await self.refresh(self.MISS_REFRESH_S)
        if name is None:
            # The default is a base model, never an adapter that happens to be listed first.
            replicas = next((r for r in self.by_name.values() if r[0].kind == kind and r[0].parent is None), None)
            if replicas is None:
                if self.failures:
                    raise self._unavailable(f"no {kind} model is reachable")
                raise ModelNotFound(NO_MODEL_OF_KIND[kind], param="model")
        else:
            replicas = self.by_name.get(name)
            if replicas is None and kind == GENERATION:
                replicas = self._on_demand(name)
            if replicas is None:
                if self.failures:
                    raise self._unavailable(f"model {name!r} is not served by any reachable backend")
                if not any(r[0].kind == kind for r in self.by_name.values()):
                    raise ModelNotFound(f"model {name!r} does not exist; {NO_MODEL_OF_KIND[kind]}", param="model")
                raise ModelNotFound(f"model {name!r} does not exist; served models: {sorted(self.by_name)}",
                                    param="model")
            if replicas[0].kind != kind:
                raise InvalidArgument(f"model {name!r} is a {replicas[0].kind} model; use "
                                      f"{ENDPOINTS[replicas[0].kind]} for it", param="model")
        return replicas[0]
