"""What every route shares: the request's catalog and a strict request-model base."""
from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from ..backends import Catalog

INT32_MAX = 2**31 - 1


class StrictBody(BaseModel):
    """A JSON body with exact types (no "5" -> 5, no 1.0 -> 1, no true -> 1) and no unknown fields,
    so nothing a caller sends is silently coerced or dropped."""

    model_config = ConfigDict(strict=True, extra="forbid")


def catalog(request: Request) -> Catalog:
    return request.app.state.catalog
