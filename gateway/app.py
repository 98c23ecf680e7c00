"""`create_app(config)`: the gateway's FastAPI app, runnable under any ASGI server (uvicorn in production)."""
from __future__ import annotations

import contextlib
import gc
import time

from fastapi import FastAPI

from . import errors
from .backends import Catalog, build_backends
from .config import GatewayConfig
from .edge import Edge
from .limits import ConcurrencyLimit, SendTimeout, TokenRateLimit, per_key_limit
from .response_store import ResponseStore
from .routes import (
    adapters,
    chat,
    completions,
    embeddings,
    health,
    messages,
    models,
    rerank,
    responses,
    stored_responses,
    tokenization,
)

ROUTERS = (chat.router, completions.router, embeddings.router, rerank.router, models.router, health.router,
           adapters.router, tokenization.router, responses.router, messages.router,
           stored_responses.router)

# uvicorn's HTTP/1.1 parser, named rather than left to "auto" so that a missing package fails at start instead of
# falling back. httptools (C) against h11 (pure Python), 64 single-sentence embedding clients, bf16, 2 vCPU: the
# gateway's CPU per request 1.30 -> 0.79-0.96 ms, and 0.74x -> 0.92x of the rate straight to the pooling service
# (bench/pooling.py --part c; docs/benchmarks.md).
HTTP_PARSER = "httptools"


def create_app(cfg: GatewayConfig) -> FastAPI:
    """The app for cfg. gRPC channels open in the lifespan, inside the loop that serves requests."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        backends = build_backends(cfg)
        for backend in backends:
            backend.open()
        app.state.backends = backends
        app.state.catalog = Catalog(backends, cfg.model_refresh_s)
        app.state.started = int(time.time())
        app.state.response_store = ResponseStore(cfg.response_store, ttl_s=cfg.response_store_ttl_s,
                                                 max_bytes=cfg.response_store_max_bytes) \
            if cfg.response_store else None
        # The app's startup objects (FastAPI, pydantic schemas, protobuf descriptors) live as long as the
        # process; frozen, full collections walk only what requests allocate (a full pass over them stalled
        # every request in flight for 100s of ms under load; docs/benchmarks.md, the pooling tail).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            for backend in backends:
                await backend.close()
            if app.state.response_store is not None:
                await app.state.response_store.close()

    app = _Gateway(title="tessera gateway", version="0.1.0", lifespan=lifespan,
                   description="OpenAI-compatible HTTP front of the tessera gRPC fleet.")
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    # Known paths label the metrics; anything else is "other", so scanners cannot blow up the label set.
    routes = frozenset([*(r.path for router in ROUTERS for r in router.routes),
                        app.openapi_url, app.docs_url, app.redoc_url])
    tenants = cfg.tenants()
    app.state.tenants = tenants
    # Added first, so they run inside Edge (the last added is outermost): refusals get ids, logs and metrics.
    # The token rate runs inside the concurrency limit, so a request refused there is never metered.
    app.add_middleware(TokenRateLimit, per_minute=cfg.max_tokens_per_minute_per_key, tenant_ids=tenants.ids)
    app.add_middleware(ConcurrencyLimit, limit=cfg.max_concurrent_requests,
                       per_key=per_key_limit(cfg.max_concurrent_per_key, cfg.max_concurrent_requests,
                                             len(tenants.keys)))
    app.add_middleware(Edge, api_keys=tenants.keys, max_body_bytes=cfg.max_body_bytes, routes=routes,
                       admin_key=cfg.admin_key, max_text_body_bytes=cfg.max_text_body_bytes,
                       max_messages=cfg.max_messages, tenant_names=tenants.names)
    app.state.config = cfg
    app.openapi = _without_422(app.openapi)
    return app


class _Gateway(FastAPI):
    """FastAPI with SendTimeout around its whole middleware stack, where it gets the server's own `send`
    (Starlette's outermost middleware wraps send, and the timeout must reach the server's transport)."""

    def build_middleware_stack(self):
        return SendTimeout(super().build_middleware_stack(), timeout_s=self.state.config.send_timeout_s)


def _without_422(build_openapi):
    """FastAPI documents 422 for every body; validation failures here are 400s (gateway/errors.py)."""

    def openapi() -> dict:
        schema = build_openapi()  # FastAPI caches it, so this edit runs on the cached copy once
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema
    return openapi
