"""Runtime LoRA administration in vLLM's shape: POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, and
GET /v1/lora_adapters (a listing). The edge lets only the admin key in (gateway/admin.py).

An adapter belongs to a base model and must be on every replica of it, or a request for it would
succeed or 404 depending on the replica it lands on. So a load goes to every decoder replica serving
the base model; if any refuses, the replicas where the name was new are unloaded again and the
refusal is the answer. An unload first checks that no replica has requests running on the adapter
(409 before anything changes), then unloads it everywhere. After either, the model list is refreshed
so the next request sees the change. Paths are judged by the decoders, inside their --lora-root;
slots are never named here: a listing says only whether an adapter is resident.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from pydantic import Field

from services.common.errors import (
    AdapterInUse,
    AdapterNotFound,
    InvalidArgument,
    ModelNotFound,
    TesseraError,
    Unavailable,
)
from services.common.pb import decoder_pb2

from .. import routing
from ..backends import GENERATION, Backend
from ..errors import request_id
from .common import ERROR_RESPONSES, StrictBody, catalog

log = logging.getLogger("tessera.gateway.adapters")

router = APIRouter()

_ADMIN_ERRORS = {**ERROR_RESPONSES, 403: {"model": ERROR_RESPONSES[401]["model"],
                                          "description": "not the admin key, or the admin endpoints are off"},
                 409: {"model": ERROR_RESPONSES[401]["model"],
                       "description": "the adapter has requests running; retry when they finish"}}
_BASE_HELP = "the base model to load it on; omitted: the one served model that accepts adapters"


class LoadLoraRequest(StrictBody):
    lora_name: str = Field(description="the name requests will use as `model`")
    lora_path: str = Field(description="a PEFT adapter folder, relative to the decoders' --lora-root")
    base_model: str | None = Field(None, description=_BASE_HELP)


class UnloadLoraRequest(StrictBody):
    lora_name: str
    base_model: str | None = Field(None, description="only from this base model; omitted: wherever it is loaded")


def _lock(request: Request) -> asyncio.Lock:
    """One admin change at a time: a load and its roll-back must not interleave with another change."""
    state = request.app.state
    lock = getattr(state, "adapter_lock", None)
    if lock is None:
        lock = state.adapter_lock = asyncio.Lock()
    return lock


async def _bases(request: Request) -> dict[str, list[Backend]]:
    """Served base language models -> their decoder replicas, freshly discovered."""
    cat = catalog(request)
    await cat.refresh(0)
    if cat.failures:
        raise Unavailable("cannot see every decoder's adapters; " + "; ".join(cat.failures.values()))
    return {name: [m.backend for m in replicas] for name, replicas in cat.by_name.items()
            if replicas[0].kind == GENERATION and replicas[0].parent is None}


async def _target(request: Request, base_model: str | None) -> tuple[str, list[Backend]]:
    """(base model, its replicas) a load goes to."""
    bases = await _bases(request)
    accepting = {name: replicas for name, replicas in bases.items()
                 if catalog(request).by_name[name][0].extra.get("max_loras", 0) > 0}
    if base_model is not None:
        if base_model not in bases:
            raise ModelNotFound(f"base model {base_model!r} is not served; language models: {sorted(bases)}",
                                param="base_model")
        if base_model not in accepting:
            raise InvalidArgument(f"model {base_model!r} takes no adapters (its decoder runs with --max-loras 0)",
                                  param="base_model")
        return base_model, accepting[base_model]
    if len(accepting) == 1:
        return next(iter(accepting.items()))
    if not accepting:
        raise InvalidArgument("no served model takes adapters: start a decoder with --max-loras >= 1",
                              param="base_model")
    raise InvalidArgument(f"several models take adapters ({sorted(accepting)}): name one with base_model",
                          param="base_model")


async def _listings(replicas: list[Backend], rid: str) -> list[decoder_pb2.ListAdaptersResponse]:
    return list(await asyncio.gather(*(b.call(b.decoder.ListAdapters, decoder_pb2.ListAdaptersRequest(), rid)
                                       for b in replicas)))


def _on(backend: Backend, err: TesseraError, several: bool) -> TesseraError:
    """err, naming the replica when there are several (the message says where it happened)."""
    if several and not err.message.startswith(backend.name):
        err.message = f"{backend.name}: {err.message}"
    return err


async def _changed(request: Request) -> None:
    """Make the next request see the change: the model list, and the routing's adapter residency."""
    await catalog(request).refresh(0)
    routing.router(request).residency.invalidate()


def _card(base: str, info: decoder_pb2.AdapterInfo) -> dict:
    return {"id": info.name, "object": "model", "owned_by": "tessera", "root": base, "parent": base,
            "kind": GENERATION, "rank": info.rank, "target_modules": list(info.target_modules),
            "digest": info.digest}


@router.post("/v1/load_lora_adapter", tags=["admin"], responses=_ADMIN_ERRORS)
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> dict:
    """Load (or replace, if no request is using it) a PEFT LoRA adapter on every replica of its base model."""
    rid = request_id(request)
    async with _lock(request):
        base, replicas = await _target(request, body.base_model)
        had = [any(a.name == body.lora_name for a in listing.adapters)
               for listing in await _listings(replicas, rid)]
        load = decoder_pb2.LoadAdapterRequest(name=body.lora_name, path=body.lora_path)
        results = await asyncio.gather(*(b.call(b.decoder.LoadAdapter, load, rid) for b in replicas),
                                       return_exceptions=True)
        failed = [(b, r) for b, r in zip(replicas, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            await _roll_back(replicas, results, had, body.lora_name, rid)
            await _changed(request)
            backend, err = failed[0]
            if not isinstance(err, TesseraError):
                raise err
            raise _on(backend, err, len(replicas) > 1)
        await _changed(request)
    log.info("adapter %s loaded from %s on %s (%d replicas) (request_id=%s)", body.lora_name, body.lora_path,
             base, len(replicas), rid)
    return {**_card(base, results[0].adapter), "replicas": len(replicas)}


async def _roll_back(replicas, results, had, name: str, rid: str) -> None:
    """Unload `name` where this load added it, so no base model ends up with it on only some replicas. (A
    replica where it replaced an older version keeps the new one: the old weights are gone.)"""
    for backend, result, existed in zip(replicas, results, had, strict=True):
        if isinstance(result, BaseException) or existed:
            continue
        try:
            await backend.call(backend.decoder.UnloadAdapter, decoder_pb2.UnloadAdapterRequest(name=name), rid)
        except TesseraError as err:
            log.error("could not roll back adapter %s on %s after a failed load: %s", name, backend.label,
                      err.message)


@router.post("/v1/unload_lora_adapter", tags=["admin"], responses=_ADMIN_ERRORS)
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> dict:
    """Unload an adapter from every replica that has it; 409 (and nothing unloaded) while requests use it."""
    rid = request_id(request)
    async with _lock(request):
        bases = await _bases(request)
        if body.base_model is not None and body.base_model not in bases:
            raise ModelNotFound(f"base model {body.base_model!r} is not served; language models: {sorted(bases)}",
                                param="base_model")
        replicas = [b for name, backends in bases.items() if body.base_model in (None, name) for b in backends]
        holding = [(b, a) for b, listing in zip(replicas, await _listings(replicas, rid), strict=True)
                   for a in listing.adapters if a.name == body.lora_name]
        if not holding:
            raise AdapterNotFound(f"adapter {body.lora_name!r} is not loaded", param="lora_name")
        busy = sum(a.refs for _, a in holding)
        if busy:
            raise AdapterInUse(f"adapter {body.lora_name!r} is used by {busy} running requests; unload it when "
                               f"they finish", param="lora_name")
        unload = decoder_pb2.UnloadAdapterRequest(name=body.lora_name)
        results = await asyncio.gather(*(b.call(b.decoder.UnloadAdapter, unload, rid) for b, _ in holding),
                                       return_exceptions=True)
        await _changed(request)
        failed = [(b, r) for (b, _), r in zip(holding, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            backend, err = failed[0]
            if not isinstance(err, TesseraError):
                raise err
            if len(failed) < len(holding):
                err.message += f" (unloaded from {len(holding) - len(failed)} of {len(holding)} replicas)"
            raise _on(backend, err, len(holding) > 1)
    log.info("adapter %s unloaded from %d replicas (request_id=%s)", body.lora_name, len(holding), rid)
    return {"id": body.lora_name, "object": "model", "deleted": True, "replicas": len(holding)}


@router.get("/v1/lora_adapters", tags=["admin"], responses=_ADMIN_ERRORS)
async def list_lora_adapters(request: Request) -> dict:
    """Every registered adapter per base model: rank, targets, content digest, and per replica whether it is
    resident on the device and how many requests are running on it."""
    rid = request_id(request)
    bases = await _bases(request)
    data = {}
    for base, replicas in bases.items():
        for backend, listing in zip(replicas, await _listings(replicas, rid), strict=True):
            for info in listing.adapters:
                card = data.setdefault((base, info.name), {**_card(base, info), "replicas": []})
                card["replicas"].append({"replica": backend.address, "resident": info.slot >= 0,
                                         "running_requests": info.refs})
    return {"object": "list", "data": list(data.values())}
