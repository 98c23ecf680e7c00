"""GET /health (the process is alive), /ready (every backend SERVING), /metrics (Prometheus)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from services.common.errors import Unavailable, openai_error

from ..errors import request_id

router = APIRouter()


@router.get("/health", tags=["health"])
async def health() -> dict:
    """Liveness: the gateway answers. Backends are /ready's business."""
    return {"status": "ok"}


@router.get("/ready", tags=["health"])
async def ready(request: Request):
    """200 when every configured backend reports SERVING over grpc.health.v1, else 503 naming the others."""
    backends = request.app.state.backends
    statuses = await asyncio.gather(*(b.health() for b in backends))
    report = {b.label: s for b, s in zip(backends, statuses, strict=True)}
    down = {label: s for label, s in report.items() if s != "SERVING"}
    if not down:
        return {"status": "ready", "backends": report}
    err = Unavailable("not ready: " + "; ".join(f"{label} is {s}" for label, s in down.items()))
    return JSONResponse({"status": "not_ready", "backends": report, **openai_error(err, request_id(request))},
                        status_code=503)


@router.get("/metrics", tags=["health"])
async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
