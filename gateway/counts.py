"""Count limits judged on a body's parsed JSON, before pydantic validates a single item of it.

Validation is the expensive part of a large body (a tool's parameters are checked against the JSON Schema
meta-schema, each logit_bias key against a pattern, each message and part built as a model), so a body
with 100,000 tools or logit_bias entries is refused by counting them first, with TooLarge (413) naming
the field. The request models run `check_counts` as a `model_validator(mode="before")`.

- content parts per message (`content` arrays of chat messages, Responses input items, Anthropic
  messages): --max-content-parts, the gateway's own, as --max-messages is.
- tools and logit_bias entries: the decoder's rule, so its numbers (RequestLimits.max_tools,
  max_logit_bias in GetModelInfo) of the model the body names; the decoder refuses by the same numbers.
- embedding inputs and rerank documents: the pooling service's rule (--max-request-inputs, published as
  ModelInfo.max_batch_size), refused as it refuses them (InvalidArgument, 400).

A backend's numbers come from the catalog already discovered (no call is made while validating: it is
synchronous). Before discovery has seen the model (the first request after start), those checks pass here
and the backend refuses by the same number once the body is parsed. The edge (gateway/edge.py) binds the
app for the request's task; a body built outside a request (a translated ChatRequest, a test) is not
counted again.
"""
from __future__ import annotations

from contextvars import ContextVar

from services.common.errors import InvalidArgument, TooLarge

from .backends import EMBEDDING, GENERATION, RERANK, Catalog

# The app serving the current request (set by the edge); None outside a request.
APP: ContextVar[object | None] = ContextVar("tessera_gateway_app", default=None)
# The list-of-items fields of each kind whose length is the pooling service's max_batch_size.
_BATCH_FIELDS = {EMBEDDING: "input", RERANK: "documents"}


def _catalog_and_parts() -> tuple[Catalog | None, int]:
    """(the app's catalog, --max-content-parts) for the current request; (None, 0) outside one."""
    app = APP.get()
    state = getattr(app, "state", None)
    config = getattr(state, "config", None)
    return getattr(state, "catalog", None), getattr(config, "max_content_parts", 0)


def _content_parts(items, most: int, field: str) -> None:
    """TooLarge when an item of `items` (messages or input items, as parsed JSON) has over `most` parts."""
    for i, item in enumerate(items if isinstance(items, list) else ()):
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list) and len(content) > most:
            raise TooLarge(f"{field}[{i}].content has {len(content)} parts, over the limit of {most}"
                           f" (max_content_parts)", param=field)


def check_counts(data, kind: str):
    """data (the parsed JSON body of a `kind` endpoint), after refusing a count over its limit (module
    docstring). For `model_validator(mode="before")`: returns data unchanged."""
    if not isinstance(data, dict):
        return data
    catalog, most_parts = _catalog_and_parts()
    if catalog is None:
        return data
    if kind == GENERATION and most_parts:
        _content_parts(data.get("messages"), most_parts, "messages")
        _content_parts(data.get("input"), most_parts, "input")
    name = data.get("model")
    model = catalog.cached(name if isinstance(name, str) else None, kind)
    if model is None:
        return data
    if kind == GENERATION and model.limits is not None:
        limits = model.limits
        tools, bias = data.get("tools"), data.get("logit_bias")
        if limits.max_tools and isinstance(tools, list) and len(tools) > limits.max_tools:
            raise TooLarge(f"{len(tools)} tools in one request; at most {limits.max_tools} per request",
                           param="tools")
        if limits.max_logit_bias and isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
            raise TooLarge(f"logit_bias has {len(bias)} entries; at most {limits.max_logit_bias} per request",
                           param="logit_bias")
    field = _BATCH_FIELDS.get(kind)
    most = model.extra.get("max_batch_size", 0)
    items = data.get(field) if field else None
    # A list of token ids is one embedding input, not many.
    if most and isinstance(items, list) and items and not isinstance(items[0], int) and len(items) > most:
        raise InvalidArgument(f"{field} has {len(items)} items, over the limit of {most}", param=field)
    return data
