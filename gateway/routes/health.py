"""GET /health (the process is alive), /ready (the backends can serve every model), /metrics (Prometheus)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from services.common.errors import Unavailable, openai_error

from .. import admin
from ..errors import request_id
from ..readiness import Readiness

router = APIRouter()


@router.get("/health", tags=["health"])
async def health() -> dict:
    """Liveness: the gateway answers. Backends are /ready's business."""
    return {"status": "ok"}


@router.get("/ready", tags=["health"])
async def ready(request: Request):
    """200 when pooling and vision report SERVING over grpc.health.v1 and every decoder model has at least one
    SERVING replica (gateway/readiness.py), else 503. Anyone may ask, so the answer says only ready or not;
    sent with the admin key (--admin-key) it also gives each backend's address and health, and a 503 names
    what is down. What is down is logged either way, once per change."""
    state = request.app.state
    backends = state.backends
    statuses = await asyncio.gather(*(b.health() for b in backends))
    report = {b.label: s for b, s in zip(backends, statuses, strict=True)}
    readiness = getattr(state, "readiness", None)
    if readiness is None:
        readiness = state.readiness = Readiness()
    if any(b.role == "decoder" for b in backends):
        # Which model each replica serves; a failed discovery is recorded in the catalog, not raised.
        await state.catalog.refresh(state.catalog.refresh_s)
        readiness.learn(state.catalog)
    down = readiness.down(backends, report)
    readiness.note(down)
    key = state.config.admin_key
    detail = admin.is_admin(key.encode() if key else None, request.headers)
    if not down:
        return {"status": "ready", "backends": report} if detail else {"status": "ready"}
    if detail:
        err = Unavailable("not ready: " + "; ".join(f"{label} is {s}" for label, s in down.items()))
        return JSONResponse({"status": "not_ready", "backends": report, **openai_error(err, request_id(request))},
                            status_code=503)
    err = Unavailable("not ready")
    return JSONResponse({"status": "not_ready", **openai_error(err, request_id(request))}, status_code=503)


@router.get("/metrics", tags=["health"])
async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
