"""Prefix-cache block hashes: a sha256 chain over full blocks. No torch here.

hash(block i) = sha256(hash(block i-1) | token ids of block i | request extra keys
| span keys overlapping block i). Two blocks share KV only if everything the
decoder consumed up to and including them is equal, so the keys must name every
input besides token ids (image content, adapter content digest, rope sections).
Python's hash() is salted per process; the encoding below is stable across
processes and never confuses 1, "1", b"1" and True.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from services.decoder.engine.request import Request, SpanKey


def _encode(value: object, out: list[bytes]) -> None:
    """Append a canonical, self-delimiting encoding of value (tag + length + payload)."""
    if value is None:
        out.append(b"N")
    elif isinstance(value, bool):
        out.append(b"T" if value else b"F")
    elif isinstance(value, int):
        raw = str(value).encode()
        out.append(b"i" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(value, float):
        raw = value.hex().encode()
        out.append(b"f" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out.append(b"s" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(value, bytes | bytearray):
        out.append(b"b" + struct.pack("<I", len(value)) + bytes(value))
    elif isinstance(value, tuple | list):
        out.append(b"(" + struct.pack("<I", len(value)))
        for item in value:
            _encode(item, out)
    else:
        # A key we cannot encode stably would silently break sharing or, worse,
        # merge distinct inputs; callers must reduce it to one of the types above.
        raise TypeError(f"cache key of type {type(value).__name__} has no stable encoding")


def encode_key(value: object) -> bytes:
    """The canonical bytes of a cache key (None, bool, int, float, str, bytes, nested tuples/lists)."""
    out: list[bytes] = []
    _encode(value, out)
    return b"".join(out)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple = (),
               span_keys: Sequence[SpanKey] = ()) -> bytes:
    """The 32-byte hash of one full block. parent is None for the first block."""
    h = hashlib.sha256()
    h.update(b"P" + (parent if parent is not None else b""))
    h.update(struct.pack(f"<I{len(token_ids)}Q", len(token_ids), *token_ids))
    h.update(encode_key(tuple(extra_keys)))
    h.update(encode_key(tuple(span_keys)))
    return h.digest()


def salt_keys(cache_salt: str) -> tuple:
    """The extra keys of a request's cache_salt (vLLM's field): in every block's hash, so requests with
    different salts share no block and one tenant's cached_tokens reveals nothing of another's prompts.
    An empty salt adds nothing: unsalted requests share as before."""
    return (("cache_salt", cache_salt),) if cache_salt else ()


def overlapping(span_keys: Sequence[SpanKey], start: int, end: int) -> tuple[SpanKey, ...]:
    """The span keys whose [s, e) meets [start, end)."""
    return tuple(k for k in span_keys if k[0] < end and start < k[1])


def extend_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Hash every full block of the request's known tokens not hashed yet; returns request.block_hashes.

    Tokens never change once known, so hashes computed earlier stay valid (also
    across preemption) and each is computed once.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, tokens[start:end], request.extra_keys,
                                 overlapping(request.span_keys, start, end)))
    return hashes
