"""Answering a Generation over HTTP: server-sent events while it streams, or whole; both end it if the client goes.

A stream is `data: {chunk}\\n\\n` events then `data: [DONE]\\n\\n`. A failure after the first event
cannot change the HTTP status any more, so it is sent as one `data: {"error": {...}}` event (OpenAI's
error object) followed by `[DONE]`: the stream always ends, never hangs. The Responses and Messages APIs
stream typed events instead (`event: <type>` before each `data:`, no `[DONE]`), and a failure midway is their
own error event, built by the route's `error_event`.

When the client disconnects, Starlette cancels the streaming body (it listens for http.disconnect);
for a whole answer `collect` listens itself. Either way the Generation is closed, which cancels the
gRPC calls, and the decoder aborts the requests and frees their blocks.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from services.common.errors import Internal, TesseraError, openai_error

from .generation import Collected, Generation

log = logging.getLogger("tessera.gateway.sse")

DONE = "data: [DONE]\n\n"
# nginx and similar proxies buffer responses unless told not to; events must reach the client as they happen.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # nginx's status for "the client closed the request"; logged, never received


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def typed_event(data: dict) -> str:
    """A typed event: its `type` field names it (OpenAI's Responses API and Anthropic's Messages API)."""
    return f"event: {data['type']}\n{event(data)}"


def stream(generation: Generation, chunks: AsyncIterator[dict], request_id: str,
           error_event: Callable[[TesseraError, str], dict] | None = None) -> StreamingResponse:
    """An SSE response of chunks (built from the started generation), ending with [DONE] or an error event.
    With error_event: typed events, and a failure midway is error_event(err, request_id)."""
    write = event if error_event is None else typed_event

    def failed(err: TesseraError) -> str:
        return event(openai_error(err, request_id)) if error_event is None else write(error_event(err, request_id))

    async def body():
        try:
            async for chunk in chunks:
                yield write(chunk)
        except TesseraError as err:
            log.warning("stream failed midway (request_id=%s): %s %s", request_id, err.reason, err.message)
            yield failed(err)
        except Exception:  # noqa: BLE001 - a bug mid-stream must still end the stream with an error event
            log.exception("stream failed midway (request_id=%s)", request_id)
            yield failed(Internal(f"internal error (request_id={request_id})"))
        finally:
            await generation.aclose()
        if error_event is None:
            yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers=HEADERS)


async def _disconnected(receive: Callable) -> None:
    """Return once the client has gone (the body was read already, so only http.disconnect is left)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, generation: Generation) -> list[Collected] | Response:
    """Every choice whole, or a 499 response if the client left first (the generation is then cancelled)."""
    work = asyncio.ensure_future(generation.collect())
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
        await generation.aclose()
    if work.cancelled():
        log.info("client disconnected before the answer; generation cancelled (request_id=%s)",
                 getattr(request.state, "request_id", "-"))
        return Response(status_code=CLIENT_CLOSED)
    return work.result()
